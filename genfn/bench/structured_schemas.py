"""JSON schemas (and regexes) the structured-output tests and benchmark run on SmolLM2: nested
objects, arrays with bounds, enums, numbers with ranges, anyOf, strings with patterns. Every object
closes its properties (``additionalProperties: false``, as OpenAI's strict mode requires) and every
free string has a ``maxLength``, so a valid answer is bounded."""

from __future__ import annotations


def _obj(properties: dict, required: list | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}


_NAME = {"type": "string", "maxLength": 24}

SCHEMAS: list[tuple[str, dict]] = [
    ("a person", _obj({"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("a city and its country", _obj({"city": _NAME, "country": _NAME})),
    ("a boolean answer to: is the sky blue?", _obj({"answer": {"type": "boolean"}})),
    ("a color", _obj({"color": {"enum": ["red", "green", "blue", "yellow"]}})),
    ("a temperature in Celsius", _obj({"celsius": {"type": "number", "minimum": -90, "maximum": 60}})),
    ("three fruits", _obj({"fruits": {"type": "array", "items": _NAME, "minItems": 3, "maxItems": 3}})),
    ("a list of one to four prime numbers", _obj({"primes": {"type": "array", "items": {"type": "integer",
                                                 "minimum": 2, "maximum": 100}, "minItems": 1, "maxItems": 4}})),
    ("a book with its author", _obj({"title": _NAME, "author": _obj({"first": _NAME, "last": _NAME})})),
    ("a US phone number", _obj({"phone": {"type": "string", "pattern": r"^\(\d{3}\) \d{3}-\d{4}$"}})),
    ("a date", _obj({"date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"}})),
    ("a rating of a movie", _obj({"movie": _NAME, "stars": {"type": "integer", "minimum": 1, "maximum": 5}})),
    ("an id that is either a number or a code", _obj({"id": {"anyOf": [{"type": "integer", "minimum": 0,
                                                                        "maximum": 9999},
                                                                       {"type": "string", "pattern": "^[A-Z]{3}$"}]}})),
    ("a point in 2D", _obj({"x": {"type": "number", "minimum": -100, "maximum": 100},
                            "y": {"type": "number", "minimum": -100, "maximum": 100}})),
    ("a weekday", _obj({"day": {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday",
                                         "Sunday"]}})),
    ("a shopping cart", _obj({"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                        "items": _obj({"product": _NAME, "quantity": {"type": "integer",
                                                                                      "minimum": 1, "maximum": 9}})}})),
    ("a hex color code", _obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}})),
    ("an animal and whether it can fly", _obj({"animal": _NAME, "flies": {"type": "boolean"}})),
    ("a percentage", _obj({"percent": {"type": "integer", "minimum": 0, "maximum": 100}})),
    ("a user with an optional nickname", _obj({"user": _NAME, "nickname": _NAME}, required=["user"])),
    ("a status", _obj({"status": {"anyOf": [{"const": "ok"}, {"const": "error"}]},
                       "code": {"type": "integer", "minimum": 100, "maximum": 599}})),
    ("a planet and its moons", _obj({"planet": {"enum": ["Mercury", "Venus", "Earth", "Mars", "Jupiter"]},
                                     "moons": {"type": "integer", "minimum": 0, "maximum": 100}})),
    ("a nested address", _obj({"address": _obj({"street": _NAME, "zip": {"type": "string",
                                                                         "pattern": "^[0-9]{5}$"}})})),
    ("two tags", _obj({"tags": {"type": "array", "items": {"enum": ["news", "sport", "tech", "art"]},
                                "minItems": 2, "maxItems": 2}})),
    ("a version number", _obj({"version": {"type": "string", "pattern": r"^\d+\.\d+\.\d+$", "maxLength": 12}})),
]

REGEXES: list[tuple[str, str]] = [
    ("a US zip code", r"[0-9]{5}"),
    ("a time of day", r"([01][0-9]|2[0-3]):[0-5][0-9]"),
    ("yes or no", r"(yes|no)"),
    ("an email address", r"[a-z]{1,12}@[a-z]{1,12}\.(com|org)"),
]
