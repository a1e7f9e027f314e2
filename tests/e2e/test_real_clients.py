"""Claude Code and Codex, the real programs from npm, against a real server: what the README's
client section promises. The SDK-driven tests send only what a test asks for; these clients
send every field their vendor's API takes today (their prompts are 7k-20k tokens), so this is
where an unknown field, a system message inside `messages` or a hosted tool shows up.

The checkpoint is scripted (scripts/scripted_model.py) with a 32k context and logits sharp
enough that the clients' own temperatures still sample the script: "Sure." then a Read call
(Claude Code's tool), then an exec_command call (Codex's). A client is offered only its own
tool, and a call to an undeclared tool is plain text, so each client sees one call. The clients
go into .clients/ (gitignored) with npm's cache, their HOME and config dirs in temporary
folders; telemetry and update checks are off. Without npm or the registry they are skipped,
except on CI (CI=true), where that fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from scripts.scripted_model import save_scripted_model
from scripts.server_process import ServerProcess

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = ROOT / ".clients"
# Pinned: a test must not change under us; bump them to check a new release.
PACKAGES = ("@anthropic-ai/claude-code@2.1.197", "@openai/codex@0.171.0")
SAYS = "Sure."
QUIET = {"DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
         "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_BUG_COMMAND": "1",
         "NO_UPDATE_NOTIFIER": "1", "CODEX_DISABLE_UPDATE_CHECK": "1"}


def _unavailable(why: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"the real clients are required on CI: {why}")
    pytest.skip(f"Claude Code / Codex not installable here: {why}")


@pytest.fixture(scope="session")
def bins(tmp_path_factory) -> dict[str, Path]:
    """claude and codex from npm, installed once into .clients/ (npm's cache kept out of HOME)."""
    found = {n: CLIENTS / "node_modules" / ".bin" / n for n in ("claude", "codex")}
    marker = CLIENTS / "installed.txt"
    if marker.exists() and marker.read_text() == " ".join(PACKAGES):
        return found
    npm = shutil.which("npm")
    if npm is None:
        _unavailable("npm is not on PATH (Debian: apt-get install nodejs npm)")
    cache = tmp_path_factory.mktemp("npm-cache")
    done = subprocess.run(
        [npm, "install", "--prefix", str(CLIENTS), "--cache", str(cache), "--no-audit",
         "--no-fund", "--no-save", "--loglevel=error", *PACKAGES],
        capture_output=True, text=True, timeout=600,
        env=dict(os.environ, HOME=str(cache), npm_config_update_notifier="false"))
    if done.returncode != 0:
        _unavailable(f"npm install failed: {done.stderr[-2000:]}")
    marker.write_text(" ".join(PACKAGES))
    return found


@pytest.fixture(scope="module")
def setup(tmp_path_factory, bins):
    work = tmp_path_factory.mktemp("work")
    (work / "note.txt").write_text("the note says forty-two\n")
    runs = work / "runs.txt"
    read = (f'<tool_call>{{"name": "Read", "arguments": {{"file_path": '
            f'"{work / "note.txt"}"}}}}</tool_call>')
    execute = (f'<tool_call>{{"name": "exec_command", "arguments": {{"cmd": '
               f'"echo ran >> {runs}"}}}}</tool_call>')
    model = save_scripted_model(tmp_path_factory.mktemp("scripted") / "model",
                                SAYS + read + execute, (read, execute),
                                max_positions=32768, sharpness=50.0)
    # Claude Code names its own models (and a Haiku one in background calls): the pattern
    # maps them all to the served one, with no ANTHROPIC_MODEL set.
    srv = ServerProcess(model, "--served-model-name", "s", "claude-*",
                        "--tool-call-parser", "hermes")
    home = tmp_path_factory.mktemp("home")
    codex_home = home / ".codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(f"""
model = "s"
model_provider = "deepinfer"
check_for_update_on_startup = false

[analytics]
enabled = false

[model_providers.deepinfer]
name = "DeepInfer"
base_url = "{srv.base_url}/v1"
wire_api = "responses"
env_key = "DEEPINFER_API_KEY"
""")
    # Nothing of the user's own setup (keys, models, base URLs) reaches the clients.
    own = {k: v for k, v in os.environ.items()
           if not k.startswith(("ANTHROPIC_", "CLAUDE_", "CODEX_", "OPENAI_"))}
    env = dict(own, **QUIET, HOME=str(home), CLAUDE_CONFIG_DIR=str(home / ".claude"),
               CODEX_HOME=str(codex_home), ANTHROPIC_BASE_URL=srv.base_url,
               ANTHROPIC_API_KEY="none", DEEPINFER_API_KEY="none",
               npm_config_cache=str(home / "npm-cache"))
    yield {"srv": srv, "env": env, "work": work, "runs": runs, **bins}
    assert srv.stop() == 0, srv.output()


def _claude(setup, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(setup["claude"]), "-p", *args], cwd=setup["work"],
                          env=setup["env"], capture_output=True, text=True, timeout=300)


def _events(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _explain(done: subprocess.CompletedProcess, setup) -> str:
    return f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}\n{setup['srv'].output()[-4000:]}"


def test_claude_code_answers(setup):
    """`claude -p`, plain: its first request (system messages inside `messages`,
    context_management, output_config, ...) is served; the answer is the script's text."""
    done = _claude(setup, "--disallowedTools", "Read", "--max-turns", "1", "hello")
    assert done.returncode == 0 and done.stdout.startswith(SAYS), _explain(done, setup)


def test_claude_code_streams_json_and_a_new_session_hits_the_cache(setup):
    """Two sessions with different first prompts: the second reads most of its prompt from the
    prefix cache (the per-session billing line is not at the prompt's start)."""
    usages = []
    for prompt in ("hello", "a different first prompt"):
        done = _claude(setup, "--output-format", "stream-json", "--verbose",
                       "--disallowedTools", "Read", "--max-turns", "1", prompt)
        events = _events(done.stdout)
        result = [e for e in events if e.get("type") == "result"]
        assert done.returncode == 0 and result, _explain(done, setup)
        last = result[-1]
        assert (last["subtype"], last["is_error"]) == ("success", False), last
        assert last["result"].startswith(SAYS)
        assert any(e.get("type") == "assistant" for e in events)
        usages.append(result[-1]["usage"])
    second = usages[1]
    total = second["input_tokens"] + second["cache_read_input_tokens"]
    assert total > 5000 and second["cache_read_input_tokens"] > 0.9 * total, usages


def test_claude_code_runs_a_tool_and_sends_its_result_back(setup):
    """The Read call runs and its result goes back: the second request (with tool_result) is
    served, and it calls Read again, which --max-turns 2 ends."""
    done = _claude(setup, "--output-format", "stream-json", "--verbose", "--max-turns", "2",
                   "read the note")
    events = _events(done.stdout)
    results = [b for e in events if e.get("type") == "user"
               for b in e["message"]["content"] if b.get("type") == "tool_result"]
    calls = [b for e in events if e.get("type") == "assistant"
             for b in e["message"]["content"] if b.get("type") == "tool_use"]
    assert len(results) >= 1 and "forty-two" in json.dumps(results[0]), _explain(done, setup)
    assert len(calls) >= 2 and calls[0]["name"] == "Read", _explain(done, setup)


def test_codex_exec_runs_a_tool_and_sends_its_result_back(setup):
    """`codex exec`: its Responses request (client_metadata, a namespace tool, web_search) is
    served, exec_command runs, and the request carrying its output is served too (the script
    calls again, so the command runs a second time; Codex has no turn limit: it is stopped)."""
    proc = subprocess.Popen(
        [str(setup["codex"]), "exec", "--skip-git-repo-check",
         "--dangerously-bypass-approvals-and-sandbox", "run the command"],
        cwd=setup["work"], env=setup["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    runs = setup["runs"]
    deadline = time.monotonic() + 300
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if runs.exists() and len(runs.read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
    finally:
        proc.kill()
        out = proc.communicate()[0]
    ran = runs.read_text().splitlines() if runs.exists() else []
    assert len(ran) >= 2, f"{out[-4000:]}\n{setup['srv'].output()[-4000:]}"

