# minipar: `make tour` (the main job), `make test` (everything CI runs), `make lab` (the course).
# Each target sets itself up on a fresh clone: a .venv with torch pinned (override: make TORCH=torch==2.14.1).
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: tour test lab figures exercises bench clean site browser

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[course,test]"
	touch $(STAMP)

tour: $(STAMP)
	$(PY) -m minipar tour

# The chapters in notebooks/ are executed once, by the site build (any error output fails it), instead of
# a second time by nbval; the browser test then runs the chapters with widgets in JupyterLab. The exercise
# notebooks are executed by tests/test_exercises.py (every check must fail on its stub), not again by nbval.
# Two pytest workers share the two cores (a module's tests stay on one worker: its fixtures are made once);
# the tests marked serial (they signal their own process, or price what this machine measured) run alone after.
PYTEST_FILES = tests minipar/course --ignore=tests/browser --ignore=tests/test_site.py
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadscope -m "not serial" $(PYTEST_FILES) solutions --nbval-lax --nbval-current-env
	$(PY) -m pytest -q -m serial $(PYTEST_FILES)
	$(MAKE) site
	MINIPAR_SITE_DIR=build/site $(PY) -m pytest -q tests/test_site.py
	$(MAKE) browser

# The course as a static site, every chapter executed now: open build/site/index.html. One chapter at a time,
# as a learner runs them: the manifest's seconds per chapter are then what a learner waits on two cores.
site: $(STAMP)
	$(PY) tools/site.py --out build/site --jobs 1

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
