"""Peak FLOP/s of one device by device kind and compute dtype: the
denominator of model FLOPs utilization (MFU).

Each figure is the vendor's dense peak per JAX device, "float32" at JAX's
default matmul precision. An unknown kind or dtype has no peak (MFU "n/a"):
a guessed peak is how an MFU above 100% gets reported.
"""

from __future__ import annotations

import dataclasses
import re

import jax

# (pattern searched in `device.device_kind`, case ignored; {dtype: dense
# peak FLOP/s per JAX device}): the first row whose pattern the kind holds
# counts, so the more specific names come first; a row of no figures keeps
# a device out of a row that is not its own. Sources: the vendors' data
# sheets.
PEAKS = (
    # Google Cloud TPU system architecture pages, per chip.
    # v6e (Trillium): 918 TFLOP/s bf16, 1836 TOP/s int8.
    (r"TPU v6( lite|e)", {"bfloat16": 918e12, "float32": 918e12,
                          "int8": 1836e12}),
    # v5e: 197 TFLOP/s bf16, 394 TOP/s int8.
    (r"TPU v5( lite|e)", {"bfloat16": 197e12, "float32": 197e12,
                          "int8": 394e12}),
    # v5p: 459 TFLOP/s bf16, 918 TOP/s int8.
    (r"TPU v5p?\b", {"bfloat16": 459e12, "float32": 459e12,
                     "int8": 918e12}),
    # v4: 275 TFLOP/s bf16 (and int8).
    (r"TPU v4\b", {"bfloat16": 275e12, "float32": 275e12, "int8": 275e12}),
    # v3: 123 TFLOP/s bf16 per chip of two cores (devices).
    (r"TPU v3\b", {"bfloat16": 61.5e12, "float32": 61.5e12}),
    # v2: 45 TFLOP/s bf16 per chip of two cores (devices).
    (r"TPU v2\b", {"bfloat16": 22.5e12, "float32": 22.5e12}),
    # NVIDIA H100 PCIe: 756 TFLOP/s bf16/fp16, 378 TF32, 1513 fp8/int8.
    (r"\bH100 PCIe", {"bfloat16": 756e12, "float16": 756e12,
                      "float32": 378e12, "float8": 1513e12,
                      "int8": 1513e12}),
    (r"\bH100 NVL", {}),
    # NVIDIA H100 SXM5 and H200 SXM: 989 TFLOP/s bf16/fp16, 495 TF32,
    # 1979 fp8/int8.
    (r"\bH[12]00\b", {"bfloat16": 989e12, "float16": 989e12,
                      "float32": 495e12, "float8": 1979e12,
                      "int8": 1979e12}),
    # NVIDIA A100 (SXM4 and PCIe, 40 and 80 GB): 312 TFLOP/s bf16/fp16,
    # 156 TF32, 624 TOP/s int8.
    (r"\bA100\b", {"bfloat16": 312e12, "float16": 312e12,
                   "float32": 156e12, "int8": 624e12}),
    # NVIDIA L40S: 362 TFLOP/s bf16/fp16, 183 TF32, 733 fp8/int8.
    (r"\bL40S\b", {"bfloat16": 362e12, "float16": 362e12, "float32": 183e12,
                   "float8": 733e12, "int8": 733e12}),
    # NVIDIA L4: 121 TFLOP/s bf16/fp16, 60 TF32, 242 fp8/int8.
    (r"\bL4\b", {"bfloat16": 121e12, "float16": 121e12, "float32": 60e12,
                 "float8": 242e12, "int8": 242e12}),
    # NVIDIA V100 SXM2: 125 TFLOP/s fp16 (tensor cores), 15.7 fp32; no bf16.
    (r"\bV100-SXM2", {"float16": 125e12, "float32": 15.7e12}),
    # NVIDIA V100 PCIe: 112 TFLOP/s fp16, 14 fp32.
    (r"\bV100-PCIE", {"float16": 112e12, "float32": 14e12}),
    # NVIDIA T4: 65 TFLOP/s fp16, 8.1 fp32, 130 TOP/s int8.
    (r"\bT4\b", {"float16": 65e12, "float32": 8.1e12, "int8": 130e12}),
)

# `jax_default_matmul_precision` values that ask for full float32 products.
_FULL_FLOAT32 = ("highest", "float32", "f32_f32_f32")


def known(device_kind: str) -> bool:
  """Whether the table has a row for `device_kind` (CPUs have none)."""
  return any(re.search(pattern, device_kind, re.IGNORECASE)
             for pattern, _ in PEAKS)


def peak_flops(device_kind: str, dtype: str | None) -> float | None:
  """One device's dense peak FLOP/s for products in `dtype`, or None where the
  table does not know it.

  Example:
    >>> from jdist._src.planning.peaks import peak_flops
    >>> peak_flops("NVIDIA A100-SXM4-80GB", "bfloat16")
    312000000000000.0
    >>> peak_flops("cpu", "float32") is None
    True
  """
  if dtype is None:
    return None
  precision = str(jax.config.jax_default_matmul_precision or "").lower()
  if dtype == "float32" and precision in _FULL_FLOAT32:
    return None
  for pattern, peaks in PEAKS:
    if re.search(pattern, device_kind, re.IGNORECASE):
      return peaks.get(dtype)
  return None


@dataclasses.dataclass(frozen=True)
class Throughput:
  """How fast a measured step computed: the program's FLOP/s, and MFU (None
  where the peak is unknown)."""

  flops_per_second: float
  flops_per_second_per_device: float
  mfu: float | None
  mfu_counts: str

  def __str__(self) -> str:
    mfu = "n/a" if self.mfu is None else f"{100 * self.mfu:.1f}%"
    return (f"{format_flops(self.flops_per_second_per_device)}/s per device, "
            f"MFU {mfu}")


def throughput(*, flops_per_device: float, num_devices: int,
               model_flops: float | None, peak_per_device: float | None,
               seconds_per_step: float) -> Throughput:
  """The `Throughput` of a step of these FLOPs that took `seconds_per_step`.

  Example:
    >>> from jdist._src.planning.peaks import throughput
    >>> t = throughput(flops_per_device=2e12, num_devices=4, model_flops=6e12,
    ...                peak_per_device=1e13, seconds_per_step=0.5)
    >>> t.flops_per_second, t.mfu, str(t)
    (16000000000000.0, 0.3, '4.0 TFLOP/s per device, MFU 30.0%')
  """
  if not seconds_per_step or seconds_per_step <= 0:
    raise ValueError(f"seconds_per_step must be positive, got "
                     f"{seconds_per_step!r}.")
  compiled = flops_per_device * num_devices
  counted = compiled if model_flops is None else model_flops
  mfu = None
  if peak_per_device:
    mfu = counted / seconds_per_step / (peak_per_device * num_devices)
  return Throughput(compiled / seconds_per_step,
                    flops_per_device / seconds_per_step, mfu,
                    "compiled" if model_flops is None else "model")


def format_flops(n: float) -> str:
  """FLOPs in decimal units: "1.2 TFLOP", "340.0 MFLOP"."""
  for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9),
                      ("MFLOP", 1e6), ("KFLOP", 1e3)):
    if abs(n) >= scale:
      return f"{n / scale:.1f} {unit}"
  return f"{n:.0f} FLOP"
