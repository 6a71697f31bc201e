"""The pydantic model structured-output checks use (bench/api/structured_output.py and the integration tests):
a nested object, an enum, an array and bounded numbers. Strings and numbers are bounded on purpose: unbounded,
a 135M model may write digits or text until max_tokens (docs/api.md)."""
from __future__ import annotations

from enum import Enum
from typing import Annotated

from pydantic import BaseModel, Field


class Colour(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=24)
    number: int = Field(ge=1, le=9999)


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    height_m: float = Field(ge=0.5, le=2.5)
    colour: Colour
    hobbies: list[Annotated[str, Field(max_length=16)]] = Field(max_length=3)
    address: Address
