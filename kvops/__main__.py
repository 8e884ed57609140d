"""python -m kvops <command>: `demo` runs the NVFP4 cold-page round trip (kvops/demo.py)."""

import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: kvops demo [--layers N] [--pages N] [--dtype D] [--device cpu|cuda]")
        return 0 if argv else 2
    if argv[0] == "demo":
        from .demo import main as demo

        return demo(argv[1:])
    print(f"kvops: unknown command {argv[0]!r}; try `kvops demo`", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
