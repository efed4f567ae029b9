# minipar: `make tour` (the main job), `make test` (everything CI runs), `make lab` (the course).
# Each target sets itself up on a fresh clone: a .venv with torch pinned (override: make TORCH=torch==2.14.1),
# installed without byte-compiling every file; tools/compile_imports.py compiles what is imported (it says why).
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: tour test lab figures exercises bench clean site browser

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile "$(TORCH)"
	$(PY) -m pip install -q --no-compile -e ".[course,test]"
	$(PY) tools/compile_imports.py
	touch $(STAMP)

tour: $(STAMP)
	$(PY) -m minipar tour

# Everything, in about 20 minutes on CI's two cores, 9 on faster ones (tools/run_tests.py says how): the tests on two
# pytest workers, the site build (every chapter executed, any error output fails it) and the browser test
# (the chapters with widgets in JupyterLab) side by side; then the serial tests and the site test alone.
test: $(STAMP)
	tools/setup_browser.sh $(PY)
	$(PY) tools/run_tests.py

# The course as a static site, every chapter executed now: open build/site/index.html. One chapter at a time,
# as a learner runs them: the manifest's seconds per chapter are then what a learner waits on two cores.
site: $(STAMP)
	$(PY) tools/site.py --out build/site --jobs 1
	MINIPAR_SITE_DIR=build/site $(PY) -m pytest -q tests/test_site.py

# JupyterLab in headless Chromium (installs Chromium and playwright first if missing; apt-get needs root).
browser: $(STAMP)
	tools/setup_browser.sh $(PY)
	$(PY) -m pytest -q tests/browser

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks

figures: $(STAMP)
	$(PY) -m minipar figures

exercises: $(STAMP)
	$(PY) -m minipar exercises

clean:
	rm -rf $(VENV) build *.egg-info
