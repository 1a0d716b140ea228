"""JSON schemas for the structured-output tests: each with a prompt that asks for it. Nested objects, enums,
arrays, required fields, string patterns, numbers with ranges, optional fields, anyOf, $ref."""
from __future__ import annotations

SCHEMAS: list[tuple[str, str, dict]] = [
    ("person", "Describe a person named Ann who is 31.", {
        "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"]}),
    ("city", "Give the capital of France and its population.", {
        "type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer", "minimum": 0,
                                                                               "maximum": 100000000}},
        "required": ["city", "population"]}),
    ("enum_color", "What color is the sky?", {
        "type": "object", "properties": {"color": {"enum": ["red", "green", "blue", "yellow"]}},
        "required": ["color"]}),
    ("bool_answer", "Is water wet?", {
        "type": "object", "properties": {"answer": {"type": "boolean"}, "reason": {"type": "string", "maxLength": 80}},
        "required": ["answer", "reason"]}),
    ("list_fruits", "List three fruits.", {
        "type": "object", "properties": {"fruits": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                    "minItems": 3, "maxItems": 3}},
        "required": ["fruits"]}),
    ("nested_address", "Give an address in Paris.", {
        "type": "object", "properties": {
            "name": {"type": "string", "maxLength": 40},
            "address": {"type": "object", "properties": {
                "street": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "city", "zip"]}},
        "required": ["name", "address"]}),
    ("phone_pattern", "Give a US phone number.", {
        "type": "object", "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{3}-[0-9]{4}$"}},
        "required": ["phone"]}),
    ("date_pattern", "When did the French revolution start?", {
        "type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
        "required": ["date"]}),
    ("number_range", "Rate pizza from 1 to 10.", {
        "type": "object", "properties": {"score": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["score"]}),
    ("float_temp", "What is the temperature in Paris today?", {
        "type": "object", "properties": {"celsius": {"type": "number", "minimum": -60, "maximum": 60}, "unit": {"const": "C"}},
        "required": ["celsius", "unit"]}),
    ("array_of_objects", "List two books with their authors.", {
        "type": "object", "properties": {"books": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                             "author": {"type": "string", "maxLength": 40}},
            "required": ["title", "author"]}}},
        "required": ["books"]}),
    ("optional_fields", "Describe a cat.", {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 30},
                                         "indoor": {"type": "boolean"}},
        "required": ["name"]}),
    ("enum_list", "Which days are weekend days?", {
        "type": "object", "properties": {"days": {"type": "array", "maxItems": 7, "items": {
            "enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]}}},
        "required": ["days"]}),
    ("sentiment", "Classify the sentiment of: 'I love this movie'.", {
        "type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                         "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["sentiment", "confidence"]}),
    ("any_of", "Give an id, either a number or a short code.", {
        "type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99999},
                                                          {"type": "string", "pattern": "^[A-Z]{3}$"}]}},
        "required": ["id"]}),
    ("ref_defs", "Describe two points on a plane.", {
        "type": "object", "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"},
                                                                               "y": {"type": "integer"}},
                                              "required": ["x", "y"]}},
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"]}),
    ("top_level_array", "List three numbers.", {
        "type": "array", "items": {"type": "integer", "minimum": -1000, "maximum": 1000}, "minItems": 3, "maxItems": 3}),
    ("email_like", "Give an email address for John.", {
        "type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"}},
        "required": ["email"]}),
    ("deep_nesting", "Describe a company with a CEO.", {
        "type": "object", "properties": {"company": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 30},
            "ceo": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                                     "since": {"type": "integer", "minimum": 1900, "maximum": 2030}},
                    "required": ["name", "since"]}},
            "required": ["name", "ceo"]}},
        "required": ["company"]}),
    ("null_union", "Give a middle name, or null if none.", {
        "type": "object", "properties": {"first": {"type": "string", "maxLength": 20},
                                         "middle": {"type": ["string", "null"], "maxLength": 20}},
        "required": ["first", "middle"]}),
    ("string_lengths", "Give a three-letter airport code for Paris.", {
        "type": "object", "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 3}},
        "required": ["code"]}),
    ("mixed_types", "Describe a product.", {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                         "price": {"type": "number", "minimum": 0, "maximum": 100000},
                                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 15},
                                                  "maxItems": 4},
                                         "in_stock": {"type": "boolean"}},
        "required": ["name", "price", "tags", "in_stock"]}),
]
