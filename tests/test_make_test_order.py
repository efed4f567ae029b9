"""make test's module order (conftest.HEAVY_FIRST): a module renamed or deleted would silently lose its place."""
from pathlib import Path

from conftest import HEAVY_FIRST

ROOT = Path(__file__).resolve().parents[1]


def test_every_heavy_module_named_exists_once():
    assert len(set(HEAVY_FIRST)) == len(HEAVY_FIRST)
    assert [name for name in HEAVY_FIRST if not (ROOT / name).is_file()] == []
