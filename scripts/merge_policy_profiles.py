"""Join policy profiles measured on the same capture sets with the same seed into one (the
settings of the later files appended to the first's), so a new policy's grid is built on its own
and added to the shipped profile without re-running the others':

    python scripts/merge_policy_profiles.py traces/policy-profile-smollm2.json new.json \\
        --out traces/policy-profile-smollm2.json --force
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SAME = ("format", "version", "seed", "captures", "how", "columns")


def merge(paths: list[Path]) -> dict:
    first = json.loads(paths[0].read_text())
    for p in paths[1:]:
        other = json.loads(p.read_text())
        differ = [k for k in SAME if other.get(k) != first.get(k)]
        if differ:
            sys.exit(f"{p}: differs from {paths[0]} in {', '.join(differ)}: not the same "
                     f"captures and method")
        twice = set(first["settings"]) & set(other["settings"])
        if twice:
            sys.exit(f"{p}: settings already in {paths[0]}: {sorted(twice)[:2]}")
        col = first["columns"].index("setting")
        offset = len(first["settings"])
        first["settings"] += other["settings"]
        for row in other["rows"]:
            row = list(row)
            row[col] += offset
            first["rows"].append(row)
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profiles", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args()
    from kvsim.errors import KvsimError
    from kvsim.policy_profile import save
    merged = merge(a.profiles)
    try:
        save(merged, a.out, a.force)
    except KvsimError as e:
        sys.exit(str(e))
    print(f"wrote {a.out}: {len(merged['settings'])} settings, {len(merged['rows']):,} rows")


if __name__ == "__main__":
    main()
