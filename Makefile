# minipar: `make tour` (the main job), `make test` (everything CI runs), `make lab` (the course).
# Each target sets itself up on a fresh clone: a .venv with torch pinned (override: make TORCH=torch==2.14.1).
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: tour test lab figures exercises bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[course,test]"
	touch $(STAMP)

tour: $(STAMP)
	$(PY) -m minipar tour

test: $(STAMP)
	$(PY) -m pytest -q tests minipar/course notebooks solutions exercises --nbval-lax --nbval-current-env

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks

figures: $(STAMP)
	$(PY) -m minipar figures

exercises: $(STAMP)
	$(PY) -m minipar exercises

clean:
	rm -rf $(VENV) build *.egg-info
