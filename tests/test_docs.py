"""The README is a front door (short, its two commands first, the ones CI runs) and the manual in
docs/ stays whole: every link resolves, every environment variable is documented."""
import pathlib
import re
import shlex

from nanovllm import envs

REPO = pathlib.Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _commands(text: str) -> list[list[str]]:
    """Each step of a shell line as its words, `python -m`/`python3 -m` and pip's -q dropped."""
    steps = []
    for step in text.split("&&"):
        words = [w for w in shlex.split(step) if w != "-q"]
        while words[:2] in (["python", "-m"], ["python3", "-m"]):
            words = words[2:]
        steps.append(words)
    return steps


def test_readme_is_short_and_starts_with_the_demo_and_the_tests():
    lines = README.splitlines()
    assert len(lines) <= 150
    assert lines[0] == "# nanovllm"
    commands = [line.strip() for line in lines[:12] if line.startswith("    ")]
    assert len(commands) == 2
    assert commands[0].endswith("&& python example.py")
    assert commands[1].endswith("&& python -m ruff check . && python -m pytest -q tests")


def test_ci_runs_the_readmes_test_command():
    test_command = [line.strip() for line in README.splitlines()[:12] if line.startswith("    ")][1]
    ci = [line.split("#")[0].strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    ci_steps = [_commands(line)[0] for line in ci if line and not line.startswith(("set ", "cd "))]
    assert ci_steps == _commands(test_command)


def test_every_link_in_the_readme_and_docs_resolves():
    broken = []
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "RESULTS.md"]
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path = target.split("#")[0]
            if path and not re.match(r"[a-z]+:", path) and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert broken == []


def test_every_environment_variable_is_in_the_options_page():
    options = (REPO / "docs" / "options.md").read_text()
    assert [v.name for v in envs.VARIABLES if f"`{v.name}`" not in options] == []


def test_benchmarks_stay_few_and_each_script_is_in_the_docs_table():
    scripts = sorted(p.name for p in (REPO / "benchmarks").iterdir() if p.name != "profiles")
    assert len(scripts) <= 25, scripts   # merge or delete the least cited (docs/benchmarks.md)
    table = (REPO / "docs" / "benchmarks.md").read_text()
    assert [s for s in scripts if f"`{s}`" not in table] == []
