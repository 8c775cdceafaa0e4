"""The tuning database: `$POLYSTRATA_HOME/tuning.sqlite` (sqlite3 from the standard library).

One row per kernel instance and machine: the key is the instance's signature (`KnobSpace.signature`: the knob
space and its version, the shapes and formats, the plan's step size), the target, the device (name and
architecture, as the runtime names it) and the compiler/driver versions; the values are the winning knobs (JSON),
the winner's and the default's measured times with their spread, and the date. Another device or another compiler
version looks up other rows, so nothing measured elsewhere applies silently. A row whose knobs equal the defaults
records that the default won (the tuner does not measure that instance again).

A second table keeps each candidate measured of an instance not yet finished (its median time, or none where it
was rejected): a session cut short by its budget goes on from there the next time, not from the start. It stays
on the machine: `export` moves the first table's rows only.

`export` / `import_file` move rows between machines as JSON (a list of rows, as `rows` returns them); an import
file is checked whole before anything is written, and written in one transaction.
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

from polystrata.errors import PolystrataError, writing
from polystrata.paths import atomic_write, home_dir, private_dir

FORMAT = "polystrata-tuning/1"
_SCHEMA = """CREATE TABLE IF NOT EXISTS tuning_v1 (
    signature TEXT NOT NULL, target TEXT NOT NULL, device TEXT NOT NULL, compiler TEXT NOT NULL,
    knobs TEXT NOT NULL, best_s REAL NOT NULL, default_s REAL NOT NULL, spread REAL NOT NULL, date TEXT NOT NULL,
    PRIMARY KEY (signature, target, device, compiler));
CREATE TABLE IF NOT EXISTS tried_v1 (
    signature TEXT NOT NULL, target TEXT NOT NULL, device TEXT NOT NULL, compiler TEXT NOT NULL,
    knobs TEXT NOT NULL, median_s REAL, spread REAL NOT NULL, date TEXT NOT NULL,
    PRIMARY KEY (signature, target, device, compiler, knobs))"""
FIELDS = ("signature", "target", "device", "compiler", "knobs", "best_s", "default_s", "spread", "date")
# Sizes an import accepts: anything larger is not a tuning file.
MAX_IMPORT_BYTES = 64 << 20
MAX_TEXT = 4096


def db_path() -> Path:
    """Where the database lives: `<home>/tuning.sqlite`."""
    return home_dir() / "tuning.sqlite"


class TuningDB:
    """The tuning database at `path` (default `db_path()`), created on first write."""

    def __init__(self, path: Path | None = None):
        self.path = path or db_path()

    @contextmanager
    def _connect(self, write: bool = False) -> Iterator[sqlite3.Connection | None]:
        """A connection (None: reading a database that does not exist yet); a write commits on success."""
        if not write and not self.path.exists():
            yield None
            return
        if write:
            private_dir(self.path.parent)
        try:
            with closing(sqlite3.connect(self.path, timeout=30)) as con:
                con.executescript(_SCHEMA)
                if write:
                    with con:
                        yield con
                else:
                    yield con
        except sqlite3.DatabaseError as e:
            raise PolystrataError(f"the tuning database {self.path} cannot be used ({e}); move it away to start "
                                  "a new one") from None

    def put(self, row: dict[str, Any]) -> None:
        """Insert or replace one row (`FIELDS`; `knobs` a dict)."""
        self.put_many([row])

    def put_many(self, rows: list[dict[str, Any]]) -> None:
        """Insert or replace rows in one transaction."""
        values = [tuple(knob_key(r["knobs"]) if f == "knobs" else r[f] for f in FIELDS)
                  for r in rows]
        with writing(self.path), self._connect(write=True) as con:
            con.executemany(f"INSERT OR REPLACE INTO tuning_v1 ({', '.join(FIELDS)}) "
                            f"VALUES ({', '.join('?' * len(FIELDS))})", values)

    def rows(self, target: str | None = None, device: str | None = None,
             compiler: str | None = None) -> list[dict[str, Any]]:
        """Rows matching the given key parts (all rows by default), ordered by signature."""
        where, args = [], []
        for name, v in (("target", target), ("device", device), ("compiler", compiler)):
            if v is not None:
                where.append(f"{name} = ?")
                args.append(v)
        sql = f"SELECT {', '.join(FIELDS)} FROM tuning_v1"
        sql += (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY signature, target, device"
        with self._connect() as con:
            if con is None:
                return []
            out = []
            for values in con.execute(sql, args):
                row = dict(zip(FIELDS, values))
                row["knobs"] = json.loads(row["knobs"])
                out.append(row)
            return out

    def put_tried(self, key: tuple[str, str, str], signature: str, knobs: dict[str, Any],
                  median_s: float | None, spread: float) -> None:
        """Keep one measured candidate of an instance (`key`: target, device, compiler; `median_s` None: rejected)."""
        with writing(self.path), self._connect(write=True) as con:
            con.execute("INSERT OR REPLACE INTO tried_v1 (signature, target, device, compiler, knobs, median_s, "
                        "spread, date) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        (signature, *key, knob_key(knobs), median_s, spread, today()))

    def tried(self, key: tuple[str, str, str], signature: str) -> dict[str, tuple[float | None, float]]:
        """The candidates of an instance measured on this machine so far: knobs (as `knob_key` spells them) ->
        (median seconds or None where rejected, spread)."""
        with self._connect() as con:
            if con is None:
                return {}
            return {k: (m, sp) for k, m, sp in con.execute(
                "SELECT knobs, median_s, spread FROM tried_v1 WHERE signature = ? AND target = ? AND device = ? "
                "AND compiler = ?", (signature, *key))}

    def unfinished(self, key: tuple[str, str, str]) -> set[str]:
        """Signatures of the instances with candidates measured on this machine and not yet finished."""
        with self._connect() as con:
            if con is None:
                return set()
            return {sig for (sig,) in con.execute("SELECT DISTINCT signature FROM tried_v1 WHERE target = ? AND "
                                                  "device = ? AND compiler = ?", key)}

    def forget_tried(self, key: tuple[str, str, str], signature: str) -> None:
        """Drop an instance's measured candidates (it is finished)."""
        with writing(self.path), self._connect(write=True) as con:
            con.execute("DELETE FROM tried_v1 WHERE signature = ? AND target = ? AND device = ? AND compiler = ?",
                        (signature, *key))

    def choices(self, target: str, device: str, compiler: str) -> dict[str, dict[str, Any]]:
        """Signature -> the knobs to override, for one machine (rows where the default won are left out)."""
        return {r["signature"]: r["knobs"] for r in self.rows(target, device, compiler) if r["knobs"]}

    def export(self, path: Path) -> int:
        """Write every row to `path` as JSON (atomically); returns the count."""
        rows = self.rows()
        doc = {"format": FORMAT, "rows": rows}
        with writing(path):
            atomic_write(path, json.dumps(doc, indent=1) + "\n")
        return len(rows)

    def import_file(self, path: Path) -> int:
        """Add the rows of a JSON file `export` wrote (replacing rows of the same key); returns the count. The
        whole file is checked first: a file that is not such JSON, or any row that is malformed, is refused with
        one line and nothing is written."""
        try:
            with open(path, "rb") as fh:
                data = fh.read(MAX_IMPORT_BYTES + 1)
        except OSError as e:
            raise PolystrataError(f"cannot read {path}: {e.strerror or e}") from None
        if len(data) > MAX_IMPORT_BYTES:
            raise PolystrataError(f"{path} is larger than {MAX_IMPORT_BYTES >> 20} MiB: not a tuning file")
        try:
            doc = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise PolystrataError(f"{path} is not a tuning file: not JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("rows"), list):
            raise PolystrataError(f"{path} is not a tuning file (expected a JSON object with \"format\": "
                                  f"\"{FORMAT}\" and \"rows\")")
        rows = [_checked_row(r, i, path) for i, r in enumerate(doc["rows"])]
        self.put_many(rows)
        return len(rows)


def _checked_row(r: Any, i: int, path: Path) -> dict[str, Any]:
    """Row `i` of an import file, checked: every field present with its type, sizes and times finite."""
    def bad(what: str) -> PolystrataError:
        return PolystrataError(f"{path}: row {i}: {what}; nothing imported")

    if not isinstance(r, dict):
        raise bad("not an object")
    missing = [f for f in FIELDS if f not in r]
    if missing:
        raise bad(f"missing {', '.join(missing)}")
    for f in ("signature", "target", "device", "compiler", "date"):
        if not isinstance(r[f], str) or not r[f] or len(r[f]) > MAX_TEXT:
            raise bad(f"{f} is not a non-empty string of at most {MAX_TEXT} characters")
    for f in ("best_s", "default_s", "spread"):
        v = r[f]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise bad(f"{f} is not a finite non-negative number")
    knobs = r["knobs"]
    if not isinstance(knobs, dict) or len(knobs) > 64:
        raise bad("knobs is not an object of at most 64 knobs")
    for k, v in knobs.items():
        if len(k) > 64 or not (isinstance(v, (int, str)) and not isinstance(v, bool)) or \
                (isinstance(v, str) and len(v) > 64):
            raise bad(f"knob {k[:64]!r} is not a short name with an integer or short string value")
    # Knob values reach generated kernel source: only those the knob space offers (its default or a candidate).
    allowed = _allowed_values(r["signature"])
    if allowed is None:
        raise bad(f"signature {r['signature'][:80]!r} names no knob space of this version")
    for k, v in knobs.items():
        if k not in allowed or v not in allowed[k]:
            raise bad(f"knob {k[:64]!r} = {str(v)[:64]!r} is not one the knob space offers")
    return {f: r[f] for f in FIELDS}


def _allowed_values(signature: str) -> dict[str, tuple] | None:
    """Knob name -> the values it may take, for the knob space (and version) a signature names; None if none."""
    from polystrata.codegen.recipes import RECIPES, load_all

    load_all()
    for recipe in RECIPES:
        space = recipe.knobs
        if space is not None and signature.startswith(f"{space.name}.v{space.version}:"):
            return {k.name: (k.default, *k.candidates) for k in space.knobs}
    return None


def knob_key(knobs: dict[str, Any]) -> str:
    """A candidate's knobs as the database spells them (JSON, sorted)."""
    return json.dumps(knobs, sort_keys=True)


def today() -> str:
    """The date a row records (UTC, ISO 8601)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
