# The two commands: `make demo` (set up, then run the main job on the tiny CPU fleet)
# and `make test` (set up, then run every test). Both install what they need.
.PHONY: setup demo test

setup:
	./scripts/bootstrap.sh

demo: setup
	.venv/bin/kvpilot demo

test: setup
	.venv/bin/python -m pytest -q -p no:cacheprovider
