"""Hardware presets as data: one YAML file per GPU in `k3/plan/hardware/`, or a user's own YAML.

Fields (per GPU; GB = 1e9 bytes, TB = 1e12 bytes): memory_gb, hbm_tb_s, nvlink_gb_s (per direction),
nvlink_domain (GPUs joined by NVLink), network_gb_s (scale-out per GPU, per direction) and
tflops.{bf16, fp8, fp4} (dense tensor-core peaks; null where the GPU has no such unit).
The public source of every preset number is listed in docs/planner.md.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml

PRECISIONS = ("bf16", "fp8", "fp4")
_FIELDS = ("name", "description", "memory_gb", "hbm_tb_s", "nvlink_gb_s", "nvlink_domain", "network_gb_s", "tflops")


@dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    memory_gb: float
    hbm_tb_s: float
    nvlink_gb_s: float
    nvlink_domain: int
    network_gb_s: float
    tflops: dict

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    @property
    def hbm_bytes_s(self) -> float:
        return self.hbm_tb_s * 1e12

    def link_bytes_s(self, nvlink: bool) -> float:
        return (self.nvlink_gb_s if nvlink else self.network_gb_s) * 1e9

    def peak_flops(self, precision: str) -> tuple[float, str]:
        """(FLOP/s, the precision actually used): a precision the GPU lacks falls back to the next wider
        one that it has (fp4 -> fp8 -> bf16), e.g. MXFP4 weights on Hopper run as FP8 matmuls."""
        if precision not in PRECISIONS:
            raise ValueError(f"compute precision {precision!r} is unknown; use one of {list(PRECISIONS)}")
        for p in PRECISIONS[PRECISIONS.index(precision)::-1]:
            if self.tflops.get(p):
                return float(self.tflops[p]) * 1e12, p
        raise ValueError(f"hardware {self.name!r} lists no tensor-core peak at {precision} or wider")

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in _FIELDS}


def preset_names() -> list[str]:
    folder = resources.files("k3.plan") / "hardware"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def _is_number(v) -> bool:
    """A finite int or float; YAML's true/false are bools, not numbers."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _yaml_hint(v) -> str:
    """PyYAML (YAML 1.1) reads 1e3 or 1.5e12, an exponent without a sign or without a dot, as a string."""
    if not isinstance(v, str):
        return ""
    try:
        float(v)
    except ValueError:
        return ""
    return " (YAML reads that as text: write the exponent with a dot and a sign, e.g. 1.0e+3, or the plain number)"


RANGE = (1e-6, 1e9)  # in the fields' own units
UNITS = {"memory_gb": "GB", "hbm_tb_s": "TB/s", "nvlink_gb_s": "GB/s", "network_gb_s": "GB/s"}


def _check_range(origin: str, field: str, v: float) -> None:
    """A size or rate outside [1e-6, 1e9] of its unit is a unit mistake, and the walls' arithmetic on it
    overflows: 1e-320 GB/s made every time infinite (`Infinity` in --json, which is not JSON)."""
    if not RANGE[0] <= v <= RANGE[1]:
        unit = UNITS.get(field, "TFLOP/s")
        raise ValueError(f"{origin}: {field} = {v!r} {unit} is outside [{RANGE[0]:g}, {RANGE[1]:g}] {unit}; "
                         f"check the unit (the field is in {unit})")


def _from_dict(d: dict, origin: str) -> Hardware:
    if not isinstance(d, dict):
        raise ValueError(f"{origin}: expected a YAML mapping with fields {list(_FIELDS)}")
    missing = [f for f in _FIELDS if f not in d and f != "description"]
    unknown = sorted(set(d) - set(_FIELDS))
    if missing or unknown:
        raise ValueError(f"{origin}: missing fields {missing}, unknown fields {unknown}; "
                         f"a hardware YAML has {list(_FIELDS)}")
    for f in ("memory_gb", "hbm_tb_s", "nvlink_gb_s", "network_gb_s"):
        v = d[f]
        if not _is_number(v) or v <= 0:
            raise ValueError(f"{origin}: {f} = {v!r} must be a positive number{_yaml_hint(v)}")
        _check_range(origin, f, v)
    v = d["nvlink_domain"]
    if not _is_number(v) or v <= 0 or v != int(v):  # 8.0 is 8; 0.5 is no number of GPUs
        raise ValueError(f"{origin}: nvlink_domain = {v!r} must be a positive whole number of GPUs (e.g. 8)")
    tf = d["tflops"]
    if not isinstance(tf, dict) or set(tf) - set(PRECISIONS):
        raise ValueError(f"{origin}: tflops must map some of {list(PRECISIONS)} to dense TFLOP/s (or null)")
    for p, v in tf.items():
        if v is not None and (not _is_number(v) or v <= 0):
            raise ValueError(f"{origin}: tflops.{p} = {v!r} must be a positive number or null{_yaml_hint(v)}")
        if v is not None:
            _check_range(origin, f"tflops.{p}", v)
    if not tf.get("bf16"):
        raise ValueError(f"{origin}: tflops.bf16 is required (the precision everything can fall back to)")
    return Hardware(name=str(d["name"]), description=str(d.get("description", "")),
                    memory_gb=float(d["memory_gb"]), hbm_tb_s=float(d["hbm_tb_s"]),
                    nvlink_gb_s=float(d["nvlink_gb_s"]), nvlink_domain=int(d["nvlink_domain"]),
                    network_gb_s=float(d["network_gb_s"]), tflops={p: tf.get(p) for p in PRECISIONS})


def _yaml_problem(e: Exception) -> str:
    """One line from a YAML error: its problem and where (1-based line:column)."""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem


def load_hardware(name_or_path: str) -> Hardware:
    """A preset by name (h100, h200, b200, gb200-nvl72) or a YAML file with the same fields."""
    if isinstance(name_or_path, Hardware):
        return name_or_path
    s = str(name_or_path)
    if s.endswith((".yaml", ".yml")) or os.sep in s:
        path = Path(s)
        if path.is_dir():
            raise ValueError(f"--hardware {s} is a directory; pass a preset name "
                             f"({', '.join(preset_names())}) or a YAML file")
        if not path.is_file():
            raise FileNotFoundError(f"hardware file {s} does not exist; pass a preset name "
                                    f"({', '.join(preset_names())}) or an existing YAML file")
        try:
            d = yaml.safe_load(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise ValueError(f"{s}: not a text file (not UTF-8); pass a hardware YAML file") from None
        except yaml.YAMLError as e:
            raise ValueError(f"{s}: not valid YAML ({_yaml_problem(e)}); fix the file or pass a preset name") from None
        return _from_dict(d, str(path))
    key = s.lower()
    names = preset_names()
    if key not in names:
        raise ValueError(f"unknown hardware {s!r}; presets: {', '.join(names)} (or pass your own FILE.yaml)")
    text = (resources.files("k3.plan") / "hardware" / f"{key}.yaml").read_text()
    return _from_dict(yaml.safe_load(text), f"preset {key}")
