"""``python -m minipar COMMAND``: ``tour`` (the main job), ``train`` (3D training from the shell) and the course's
commands; ``python -m minipar --help`` says what each does, ``python -m minipar COMMAND --help`` its options."""
import importlib
import sys
import textwrap

COMMANDS = {  # name: (module whose main(argv) runs it, what it does)
    "tour": ("minipar.course.tour", "the main job: every strategy implemented so far on 4 CPU ranks, each "
                                    "checked against one device, in one table"),
    "figures": ("minipar.course.figures", "make the course's pictures from real runs into figures/"),
    "exercises": ("minipar.course.exercises", "write exercises/ from solutions/ (--check: exit 1 if out of date)"),
    "bench": ("minipar.course.bench", "time minipar against PyTorch's own on the same model, or record a "
                                      "chapter's measurements (python -m minipar bench --help lists them)"),
    "train": ("minipar.hybrid.cli", "train the tiny GPT on a dp × pp × cp × tp (× ep) mesh, local processes "
                                    "or torchrun's; save and resume in any layout"),
    "export-dcp": ("minipar.hybrid.dcp_export", "write a train --save checkpoint in torch.distributed.checkpoint's "
                                                "format (dcp.load reads it)"),
}


def usage() -> str:
    """The command list, one line each, as ``git`` and ``torchrun`` print theirs, then the benchmarks ``bench``
    runs, one line each (what ``python -m minipar bench --help`` lists)."""
    bench = importlib.import_module(COMMANDS["bench"][0])     # loaded when asked, as main() loads a command
    available, describe = bench.benchmarks(), bench.describe
    return "\n".join([f"usage: python -m minipar {{{','.join(COMMANDS)}}} [options]", "", "commands:",
                      listing({name: what for name, (_, what) in COMMANDS.items()}), "",
                      "benchmarks (python -m minipar bench NAME):",
                      listing({name: describe(available[name]) for name in sorted(available)}), "",
                      "python -m minipar COMMAND --help: that command's options"])


def listing(described: dict) -> str:
    """``{name: what it does}`` as ``  name  what it does``, the descriptions aligned and wrapped at 100 columns."""
    width = max(map(len, described), default=0)
    return "\n".join(textwrap.fill(what, 100, initial_indent=f"  {name:<{width}}  ",
                                   subsequent_indent=" " * (width + 4)) for name, what in described.items())


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        unknown = f"python -m minipar: unknown command {argv[0]!r}\n" if argv else ""
        print(unknown + usage(), file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
