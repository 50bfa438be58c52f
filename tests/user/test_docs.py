"""The documentation site builds with warnings as errors, and its configuration reference is the schema's text,
the same that ``grpo-accel train --help`` prints."""
import re
import subprocess
import sys

import pytest

from launching import ROOT


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "docs" / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=600,
                          env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    from grpo_accel.config.reference import keys

    page = (tmp_path / "site" / "reference" / "configuration" / "index.html").read_text()
    missing = [k.name for k in keys() if f"<code>{k.name}</code>" not in page]
    assert not missing and len(keys()) > 100, missing
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert "GRPOTrainer" in api and "total_frames" in api, "the trainer's docstring, rendered"


def test_help_prints_every_key_with_its_type_default_and_meaning(capsys):
    """As plain text: the schema's reST markup (``x``, :func:`x`) left out."""
    from grpo_accel.cli.text import plain
    from grpo_accel.cli.train import main
    from grpo_accel.config.reference import keys

    with pytest.raises(SystemExit):
        main(["--help"])
    text = re.sub(r"\s+", " ", capsys.readouterr().out)
    for key in keys():
        assert f"{key.name}={key.default} ({key.type}) {' '.join(plain(key.meaning).split())}" in text, key.name


def test_the_readmes_links_into_the_repository_reach_a_file_and_heading():
    """The site's build checks the pages' own links and headings; the README is outside it, so its links are checked
    here, each heading slug as the site's table of contents makes it."""
    from markdown.extensions.toc import slugify

    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((?!https?://)([^)#\s]+)(?:#([^)\s]+))?\)", readme)
    assert len(links) > 10
    for path, anchor in links:
        target = ROOT / path
        assert target.exists(), f"README links to {path}, which is not in the repository"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            assert anchor in {slugify(h.replace("`", ""), "-") for h in headings}, f"{path} has no heading #{anchor}"


def test_every_code_line_of_the_docs_fits_the_page():
    """Issue 65: a code block wider than the page scrolls sideways at 1280 px and hides its right half (the TRL
    translation block hid TRL's arithmetic). Every line of a fenced block in docs/pages is at most 100 characters."""
    wide = []
    for page in sorted((ROOT / "docs" / "pages").rglob("*.md")):
        inside = False
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                inside = not inside
            elif inside and len(line) > 100:
                wide.append(f"{page.name}:{number} ({len(line)})")
    assert wide == []


def test_the_api_pages_trainer_by_hand_runs_as_written(tmp_path, monkeypatch, capsys):
    """Issue 74 item 13: api.md named parts without their imports, nor EmbeddedEngine's required max_new_tokens,
    ReplayBuffer's pad id, save_trainer_interval's checkpoint, or which frames a post_collect hook sees."""
    from trainer_utils import reset_accelerate_state

    page = (ROOT / "docs" / "pages" / "api.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", page, re.S)
    monkeypatch.chdir(tmp_path)
    try:
        exec(compile(code, "api.md", "exec"), {"__name__": "api_md"})  # noqa: S102 - the page's own example
    finally:
        reset_accelerate_state()
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("batch ")]
    assert said == [f"batch {i}: 16 completions, {16 * i} frames" for i in range(1, 5)]
    assert sorted(p.name for p in (tmp_path / "runs" / "by_hand").iterdir()) == ["step_00000002", "step_00000004"]

