"""Write requirements.lock: the exact versions in this venv of everything `swarmlm[dev]` needs (pip freeze,
narrowed to swarmlm's dependency closure). torch is pinned without its local label (==2.13.0 matches the CPU
wheel); CUDA packages are left out (the CPU build needs none).

    .venv/bin/python .ci/lock.py > requirements.lock
"""
from __future__ import annotations

import re
from importlib import metadata

from packaging.requirements import Requirement

SKIP = re.compile(r"^(nvidia-|cuda-|triton$)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(root: str, extras: set[str]) -> dict[str, str]:
    """Installed distribution name -> version, for root[extras] and everything it requires (markers evaluated)."""
    found: dict[str, str] = {}
    todo = [(root, frozenset(extras))]
    seen: set[tuple[str, frozenset]] = set()
    while todo:
        name, wanted = todo.pop()
        if (canonical(name), wanted) in seen:
            continue
        seen.add((canonical(name), wanted))
        dist = metadata.distribution(name)
        found[dist.metadata["Name"]] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            envs = [{"extra": e} for e in wanted] or [{"extra": ""}]
            if req.marker is not None and not any(req.marker.evaluate(env) for env in envs):
                continue
            todo.append((req.name, frozenset(req.extras)))
    return found


def main() -> None:
    pins = closure("swarmlm", {"dev"})
    print("# exact versions of swarmlm[dev]'s dependencies, from a working venv (.ci/lock.py); make installs these")
    for name, version in sorted(pins.items(), key=lambda kv: canonical(kv[0])):
        if canonical(name) == "swarmlm" or SKIP.match(canonical(name)):
            continue
        print(f"{name}=={version.split('+')[0]}")


if __name__ == "__main__":
    main()
