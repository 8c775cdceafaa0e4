"""Where PolyStrata keeps its files: one home directory (`$POLYSTRATA_HOME`, else `~/.cache/polystrata`) holding
`models/` (the zoo) and `kernels/` (the kernel cache)."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_HOME = "~/.cache/polystrata"


def home_dir() -> Path:
    """PolyStrata's home: `$POLYSTRATA_HOME` with `~` expanded; unset or empty means `~/.cache/polystrata`."""
    return Path(os.environ.get("POLYSTRATA_HOME") or DEFAULT_HOME).expanduser()


def private_dir(path: Path) -> Path:
    """Create `path` and its missing parents with user-only permissions (0o700); existing ones are left as
    they are. Returns `path`."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        # mode applies to this directory only (makedirs gives parents the umask's default), hence one by one.
        d.mkdir(mode=0o700, exist_ok=True)
    return path
