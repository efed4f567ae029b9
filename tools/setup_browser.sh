#!/usr/bin/env bash
# Set up what the browser test (tests/browser/) needs, on a fresh Debian/Ubuntu machine or CI runner:
#   * Chromium from the distribution (Debian: package `chromium`; `playwright install` needs a download
#     that is not possible everywhere, so the test drives the system browser through `executable_path`);
#   * a font with Chinese glyphs (Debian's Noto CJK), or the glossaries' 中文 render as empty boxes in the
#     browser's screenshots (fc-list :lang=zh lists none on a bare machine);
#   * the Playwright Python package in the project's virtual environment.
# Idempotent: does nothing that is already done. Usage: tools/setup_browser.sh [path/to/python]
set -euo pipefail
PY="${1:-${PY:-.venv/bin/python}}"

find_chromium() {
    for name in chromium chromium-browser google-chrome; do
        if command -v "$name" >/dev/null 2>&1; then command -v "$name"; return 0; fi
    done
    return 1
}

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null 2>&1; then sudo "$@"; else
        echo "setup_browser: not root and no sudo: run '$*' as root" >&2; return 1
    fi
}

if ! find_chromium >/dev/null; then
    SUDO=""
    if [ "$(id -u)" != 0 ]; then
        if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
            echo "setup_browser: Chromium is missing and this is not root: run 'apt-get install -y chromium' as root" >&2
            exit 1
        fi
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "setup_browser: no apt-get here: install Chromium with your package manager, or set CHROMIUM=/path/to/chrome" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    # Debian calls it `chromium`; Ubuntu's `chromium-browser` is a snap stub, so prefer `chromium`.
    $SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null \
        || $SUDO apt-get install -y -qq chromium-browser >/dev/null
fi
if ! fc-list :lang=zh 2>/dev/null | grep -q .; then
    if command -v apt-get >/dev/null 2>&1; then
        export DEBIAN_FRONTEND=noninteractive
        as_root apt-get update -qq
        as_root apt-get install -y -qq --no-install-recommends fonts-noto-cjk fontconfig >/dev/null
    else
        echo "setup_browser: no apt-get here: install a CJK font (Noto Sans CJK) so that 中文 renders" >&2
    fi
fi
echo "setup_browser: Chinese font: $(fc-list :lang=zh family 2>/dev/null | head -1 || echo none)"
echo "setup_browser: chromium at $(find_chromium) ($("$(find_chromium)" --version 2>/dev/null || echo '?'))"

if ! "$PY" -c "import playwright" 2>/dev/null; then
    "$PY" -m pip install -q --no-compile "playwright>=1.40"
fi
echo "setup_browser: playwright $("$PY" -c 'from importlib.metadata import version; print(version("playwright"))')"
