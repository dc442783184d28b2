"""Hardware presets (the papers' machines, planner/hardware_presets/*.json) and spec files."""
from __future__ import annotations

import json
from pathlib import Path

from tensorstow.errors import TensorstowError
from tensorstow.schema.hardware import Hardware

PRESET_DIR = Path(__file__).parent / "hardware_presets"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json")) + ["local"]


def load_hardware(spec: str) -> Hardware:
    """`spec` is a preset name or a path to a JSON spec file (`local`, a probe of this machine,
    is `tensorstow.calibrate.hardware_for`'s)."""
    path = PRESET_DIR / f"{spec}.json"
    if not path.exists():
        path = Path(spec)
        if not path.exists() or path.is_dir():
            raise TensorstowError(
                f"unknown hardware '{spec}': not a preset ({', '.join(preset_names())}) "
                f"and not a spec file")
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TensorstowError(f"hardware spec {path}: not valid JSON ({e}); fix the file or "
                              f"regenerate it with `tensorstow probe -o {path}`") from None
    return Hardware.from_json(d, where=f"hardware spec {path}")
