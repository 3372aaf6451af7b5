"""Tensors on the wire: `{"dtype", "shape", "data"}` with `data` the base64 of the raw
little-endian, row-major bytes, or raw `application/octet-stream` bodies. Never pickle, never
JSON float lists.

Decoding validates everything a client can get wrong and raises `ApiError` naming the field:
the dtype, the shape against the expected one, the byte length, malformed base64, empty
tensors, NaN and Inf."""

from __future__ import annotations

import base64
import binascii
import json
import math
import sys
from typing import Annotated, Any

import torch
from annotated_types import Ge, Le
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic import Strict as StrictMode
from safetensors import SafetensorError
from safetensors.torch import load, save

from .errors import invalid

FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
WIRE_DTYPES = {**FLOAT_DTYPES, "float64": torch.float64, "int64": torch.int64}
DTYPE_NAMES = {dtype: name for name, dtype in WIRE_DTYPES.items()}

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("rewa.service.wire assumes a little-endian machine")


def _json_integer(value: Any) -> Any:
    """JSON Schema's integer: a number without a fraction (23 or 23.0), never a bool or a
    string."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("expected an integer")
    return value


def integer(ge: int | None = None, le: int | None = None) -> Any:
    """The type of a JSON integer field, with its bounds (in the annotation, so that they
    reach the JSON schema as minimum and maximum)."""
    bounds = [
        bound
        for bound in (Ge(ge) if ge is not None else None, Le(le) if le is not None else None)
        if bound is not None
    ]
    return Annotated[int, *bounds, StrictMode(False), BeforeValidator(_json_integer)]


Integer = integer()


class TensorPayload(BaseModel):
    """A tensor inside JSON."""

    model_config = ConfigDict(extra="forbid", strict=True)

    dtype: str = Field(json_schema_extra={"enum": sorted(WIRE_DTYPES)})
    shape: list[Integer] = Field(description="row-major (C order)")
    data: str = Field(description="base64 of the raw little-endian bytes")


def encode(tensor: torch.Tensor) -> dict:
    """`TensorPayload` fields for a tensor (moved to the CPU, made contiguous)."""
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.dtype not in DTYPE_NAMES:
        tensor = tensor.to(torch.float32)
    raw = tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    return {
        "dtype": DTYPE_NAMES[tensor.dtype],
        "shape": list(tensor.shape),
        "data": base64.b64encode(raw).decode("ascii"),
    }


def decode(
    payload: TensorPayload,
    param: str,
    shape: tuple[int | None, ...],
    dtypes: tuple[str, ...] = tuple(FLOAT_DTYPES),
) -> torch.Tensor:
    """The tensor of `payload`, checked against `shape` (None: any size >= 1) and `dtypes`."""
    if payload.dtype not in dtypes:
        raise invalid(f"{param}.dtype", f"one of {list(dtypes)}", payload.dtype)
    check_shape(f"{param}.shape", payload.shape, shape)
    try:
        raw = base64.b64decode(payload.data, validate=True)
    except (binascii.Error, ValueError) as error:
        raise invalid(f"{param}.data", "base64 (RFC 4648, with padding)", str(error)) from None
    return from_bytes(raw, payload.dtype, tuple(payload.shape), param)


def from_bytes(raw: bytes, dtype: str, shape: tuple[int, ...], param: str) -> torch.Tensor:
    """A tensor from raw bytes, checking the length and finiteness."""
    torch_dtype = WIRE_DTYPES[dtype]
    expected = math.prod(shape) * torch_dtype.itemsize
    if len(raw) != expected:
        raise invalid(
            param, f"{expected} bytes for {dtype} of shape {list(shape)}", f"{len(raw)} bytes"
        )
    tensor = torch.frombuffer(bytearray(raw), dtype=torch_dtype).reshape(shape)
    if torch_dtype.is_floating_point and not bool(torch.isfinite(tensor).all()):
        raise invalid(param, "finite values", "NaN or Inf")
    return tensor


def check_shape(param: str, got: list[int] | tuple[int, ...], expected: tuple[int | None, ...]):
    """Raise unless `got` matches `expected` (None entries: any size >= 1)."""
    described = "[" + ", ".join("n" if size is None else str(size) for size in expected) + "]"
    if len(got) != len(expected) or any(
        size < 1 if want is None else size != want
        for size, want in zip(got, expected, strict=False)
    ):
        raise invalid(param, f"shape {described} (no empty dimension)", list(got))


# -- safetensors bodies -----------------------------------------------------------------------
# The binary wire of attend: a safetensors file (https://huggingface.co/docs/safetensors: an
# 8-byte little-endian header length, a JSON header of dtypes, shapes and offsets, then the raw
# tensors) as the request or response body, chosen by Content-Type and Accept.

SAFETENSORS = "application/x-safetensors"
_SAFETENSORS_FLOATS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def read_safetensors(raw: bytes, param: str = "body") -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and the `__metadata__` (str -> str) of a safetensors body; anything malformed
    or non-finite is a 400 naming `param`."""
    if len(raw) < 8:
        raise invalid(param, "a safetensors body (8-byte header length, header, data)", len(raw))
    header_length = int.from_bytes(raw[:8], "little")
    try:
        if header_length > len(raw) - 8:
            raise ValueError(f"a header of {header_length} bytes in a body of {len(raw)}")
        header = json.loads(raw[8 : 8 + header_length])
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        metadata = header.get("__metadata__") or {}
        tensors = load(raw)
    except (ValueError, SafetensorError) as error:
        raise invalid(param, "a safetensors body", str(error)) from None
    for name, entry in header.items():
        if name != "__metadata__" and entry.get("dtype") not in _SAFETENSORS_FLOATS:
            raise invalid(f"{param}.{name}.dtype", f"one of {sorted(_SAFETENSORS_FLOATS)}", entry)
    for name, tensor in tensors.items():
        if not bool(torch.isfinite(tensor).all()):
            raise invalid(f"{param}.{name}", "finite values", "NaN or Inf")
    return tensors, metadata


def write_safetensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """A safetensors body of CPU-contiguous copies of `tensors`."""
    return save({name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}, metadata)
