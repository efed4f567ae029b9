"""``python -m minipar tour`` (the main job) and the other course commands."""
import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"tour": "minipar.tour", "figures": "minipar.figures", "exercises": "minipar.exercises",
                "bench": "minipar.bench"}
    if not argv or argv[0] not in commands:
        print(f"usage: python -m minipar {{{','.join(commands)}}} [options]", file=sys.stderr)
        return 2
    import importlib
    return importlib.import_module(commands[argv[0]]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
