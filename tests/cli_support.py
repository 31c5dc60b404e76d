"""What the CLI tests share: running ``genfn`` as a subprocess, the one-line error check, and a
tiny random Llama with a trained byte-level BPE tokenizer (and a chat template) that loads in a
second."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading

import torch

WAIT = 300  # seconds a CLI subprocess may take at most (imports torch on a shared machine)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A minimal ChatML template, the format SmolLM2's own template writes.
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def subprocess_env() -> dict:
    """This process's environment with the checkout first on ``PYTHONPATH`` and one OpenMP thread
    (servers and ranks started by tests share the machine)."""
    return {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}


def run_cli(*args, stdin: str | None = None, module: str = "genfn.cli"):
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          input=stdin if stdin is not None else "", timeout=WAIT, env=env, cwd=REPO)


def assert_user_error(result, *words):
    """Exit status 2; stderr ends with one ``genfn: error:`` line naming ``words``, after at most
    status lines (each ``genfn: ...``), and nothing on stdout."""
    assert result.returncode == 2, result
    lines = result.stderr.splitlines()
    assert lines and lines[-1].startswith("genfn: error: "), result.stderr
    assert all(line.startswith("genfn: ") and not line.startswith("genfn: error") for line in lines[:-1]), \
        result.stderr
    assert result.stdout == ""
    for word in words:
        assert word in lines[-1], (word, lines[-1])


def build_tiny_model(path, chat_template: str | None = None):
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>"] + (["<|im_start|>", "<|im_end|>"] if chat_template else [])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The capital of France is Paris. Say hi to everyone."] * 8, trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    if chat_template:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, bos_token_id=0, eos_token_id=1)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


class ServerProcess:
    """A process whose stderr is collected; ``url`` once it prints where it listens."""

    def __init__(self, command: list[str]):
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                        env=subprocess_env(), cwd=REPO)
        self.lines: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stderr:
            self.lines.append(line)
            found = re.search(r"listening on (http://\S+)", line)
            if found and self.url is None:
                self.url = found.group(1)
                self._ready.set()
        self._ready.set()

    def wait_listening(self, timeout: float = WAIT) -> str:
        if not self._ready.wait(timeout) or self.url is None:
            self.kill()
            raise AssertionError(f"the server did not start: {self.log()}")
        return self.url

    def wait(self, timeout: float) -> int:
        code = self.process.wait(timeout)
        self._reader.join(10)
        return code

    def log(self) -> str:
        return "".join(self.lines)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def child_pids(pid: int) -> list[int]:
    """The processes ``pid`` started (Linux's ``/proc``); empty once it is gone."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
