"""The examples of the README and docs/ run as written and print what their comments say."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
LIBRARY = ROOT / "docs" / "library.md"
DEPLOY = ROOT / "docs" / "deploy.md"


def test_library_example_runs_and_prints_what_it_claims():
    text = README.read_text()
    example = re.search(r"## Library\n\n```python\n(.*?)```", text, re.S).group(1)
    result = subprocess.run(
        [sys.executable, "-c", example], capture_output=True, text=True, timeout=300, check=True
    )
    lines = result.stdout.splitlines()
    assert lines[0] == "torch.Size([2, 8, 1024, 64]) torch.Size([2, 8, 1024])"
    assert lines[1] == "True"
    assert len(json.loads(lines[2])) == 4  # one kappa_eff per head


def run_section(heading: str) -> list[str]:
    """Run the first Python block after `heading` with the shapes of `out` and `lse` printed
    after it; its output lines."""
    text = LIBRARY.read_text()
    example = re.search(re.escape(heading) + r"\n.*?```python\n(.*?)```", text, re.S)
    code = example.group(1) + "\nprint(tuple(out.shape), tuple(lse.shape))\n"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    return result.stdout.strip().splitlines()


def test_riemann_example_runs_and_prints_what_it_claims():
    text = LIBRARY.read_text()
    heading = "## RiemannFormer, mixtures, layers and training aids"
    example = re.search(re.escape(heading) + r"\n\n```python\n(.*?)```", text, re.S).group(1)
    result = subprocess.run(
        [sys.executable, "-c", example], capture_output=True, text=True, timeout=300, check=True
    )
    assert result.stdout.splitlines() == [
        "torch.Size([2, 64, 128])",
        "torch.Size([2, 64, 128]) True",
        "['euclidean', 'hyperbolic']",
    ]


def test_sparse_example_runs():
    assert run_section("## Sparse and retrieval attention")[-1] == "(100, 64) (100,)"


def test_tail_example_runs():
    assert run_section("## Cluster-tail attention") == ["True", "(2, 100, 64) (2, 100)"]


def test_service_curl_example_runs_against_a_live_server():
    from tests.service_support import Server, decode

    text = README.read_text()
    script = re.search(r"## Service\n.*?```bash\n(.*?)```", text, re.S).group(1)
    server = Server().start()
    try:
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
            env={"REWA": f"127.0.0.1:{server.port}", "PATH": "/usr/bin:/bin"},
        )
    finally:
        server.kill()
    version, response = result.stdout.strip().splitlines()
    assert version == "1"
    body = json.loads(response)
    out, lse = decode(body["out"]), decode(body["lse"])
    assert [round(x, 2) for x in out.flatten().tolist()] == [0.67, 0.33]
    assert round(lse.item(), 3) == 1.108


def test_deploy_sharding_example_builds_its_sharded_memory():
    text = DEPLOY.read_text()
    example = re.search(r"\*Contexts larger than one device\.\*.*?```python\n(.*?)```", text, re.S)
    code = example.group(1) + "\nprint(len(memory.shards), memory.shards[1].context_id)\n"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert result.stdout.split() == ["2", "ctx-second-half"]


def test_the_model_memory_example_generates_what_full_attention_generates():
    text = README.read_text()
    example = re.search(r"## A model's memory\n.*?```python\n(.*?)```", text, re.S).group(1)
    result = subprocess.run(
        [sys.executable, "-c", example], capture_output=True, text=True, timeout=300, check=True
    )
    assert result.stdout.splitlines() == ["1276", "True"]


def test_the_llm_guide_example_runs():
    text = (ROOT / "docs" / "llm.md").read_text()
    example = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    code = example + "\nprint(tokens.shape[1])\n"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert 2000 < int(result.stdout) <= 2032  # the prompt and up to 32 generated tokens


def test_the_quick_start_runs_against_a_live_server(tmp_path):
    """The quick start's Python, `rewa` and curl blocks, run as written except for the context's
    length (131072 -> 8192 tokens, to keep the suite fast) and the server's address."""
    from tests.service_support import Server

    text = README.read_text()
    section = re.search(r"## Quick start: a 128k-token context\n(.*?)\n## ", text, re.S).group(1)
    python_block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    cli_block, curl_block = re.findall(r"```bash\n(.*?)```", section, re.S)
    server = Server().start()

    def shell(script: str) -> list[str]:
        script = script.replace("131072", "8192").replace(".venv/bin/", f"{ROOT}/.venv/bin/")
        env = {"REWA_URL": server.url, "REWA": f"127.0.0.1:{server.port}", "PATH": "/usr/bin:/bin"}
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
            cwd=tmp_path,
            env=env,
        )
        return done.stdout.splitlines()

    try:
        code = python_block.replace("131072", "8192").replace("http://127.0.0.1:8000", server.url)
        found = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
        )
        assert found.stdout.strip() == "(8, 4, 64) (8, 4)"
        table = shell(cli_block)
        answer = shell(curl_block)
    finally:
        server.kill()
    assert "version 1, mode tail" in table[0]
    assert table[2].split()[:2] == ["0", "0"]  # a row per head and query: the first 20
    assert "... 12 more rows" in table
    assert answer[0] == "8192"  # tokens committed
    lse = np.array(
        [float(x) for x in " ".join(answer[1:]).replace("[", " ").replace("]", " ").split()]
    )
    assert lse.shape == (32,) and np.isfinite(lse).all()  # the (8, 4) lse, decoded


DOC_SECTION = re.compile(r'(?:docs/)?([a-z-]+)\.md,?\s+"([^"]+)"')


def test_code_points_to_sections_that_exist():
    """A comment or docstring that names a section of a document (`docs/indexes.md, "Appends"`)
    names one that the document has."""
    headings = {
        path.stem: {
            line.lstrip("#").strip().lower()
            for line in path.read_text().splitlines()
            if line.startswith("#")
        }
        for path in (ROOT / "docs").glob("*.md")
    }
    missing, found = [], 0
    for package in ("attention", "index", "service", "clients", "llm", "research", "benchmarks"):
        for path in (ROOT / package).rglob("*.py"):
            # References wrap across lines, inside comments too.
            text = re.sub(r"\n\s*#?\s*", " ", path.read_text())
            for document, section in DOC_SECTION.findall(text):
                found += 1
                if section.lower() not in headings.get(document, ()):
                    missing.append(f"{path.relative_to(ROOT)}: {document}.md, {section!r}")
    assert found > 30
    assert not missing, "\n".join(missing)
