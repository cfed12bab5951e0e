"""``python -m tether``: the ``tether`` command line."""

from tether.cli import app

if __name__ == "__main__":
    app(prog_name="tether")
