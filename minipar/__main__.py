"""``python -m minipar tour`` (the main job), ``python -m minipar train`` (3D training) and the course commands."""
import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"tour": "minipar.course.tour", "figures": "minipar.course.figures",
                "exercises": "minipar.course.exercises", "bench": "minipar.course.bench",
                "train": "minipar.hybrid.cli"}
    if not argv or argv[0] not in commands:
        print(f"usage: python -m minipar {{{','.join(commands)}}} [options]", file=sys.stderr)
        return 2
    import importlib
    return importlib.import_module(commands[argv[0]]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
