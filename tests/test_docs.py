"""The README's quick-start commands are the ones CI runs, and the docs name what exists."""

import re
from pathlib import Path

from compresskit.models import available

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _commands():
    return re.findall(r"```bash\n(.+?)\n```", README)


def test_readme_opens_with_run_and_test_commands():
    run, test = _commands()[:2]
    assert "pip install torch==2.13.0" in run and run.endswith("compress demo")
    assert "pip install torch==2.13.0" in test and "pytest" in test


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _commands()[1] in ci


def test_readme_lists_every_zoo_model():
    for name in available():
        assert f"| `{name}` |" in README


def test_archive_format_doc_matches_the_module():
    from compresskit.compressor import archive

    doc = (ROOT / "docs" / "archive-format.md").read_text()
    assert archive.__doc__.strip() in doc
