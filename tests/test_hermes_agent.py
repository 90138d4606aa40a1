"""The reference validation, reproduced with the real hermes-agent (installed from PyPI into
clients/.install): ten `hermes -z` tasks in a row against one `flashtree serve` on the embedded
model at --max-ctx 65536. The server stays up and answers every request, and after the first
request most prompt tokens come from the prefix cache. Then the same ten tasks against a server
that runs out of memory once, in the middle (FLASHTREE_FAULTS): that one request gets a
retryable 503 out_of_memory error, hermes retries it, and every task still completes.

Everything a run leaves (server log, transcript of every exchange, hermes' output per task) is
kept under pytest's tmp_path for inspection.
"""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's clients/ package

from clients import install, report  # noqa: E402
from clients.common import Endpoint, run_client  # noqa: E402
from clients.hermes import Hermes  # noqa: E402
from clients.proxy import RecordingProxy  # noqa: E402
from clients.server import FlashtreeServer  # noqa: E402
from flashtree.runtime.engine import ASSETS  # noqa: E402

TOOLSETS = "file,terminal"  # six tools: a realistic agent prompt that a CPU prefills in seconds
MAX_TOKENS = 8              # hermes continues a cut answer with doubled limits: 8+16+32+64 at most
PREFILL_UBATCH = 512
KEY = "sk-hermes-test"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hermes_client():
    if not (ASSETS / "target").is_dir():
        pytest.skip("the embedded model (flashtree/assets/target) is not in this checkout yet")
    try:
        install.hermes()
    except install.InstallError as e:
        pytest.skip(f"hermes-agent cannot be installed here: {e}")
    return Hermes(toolsets=TOOLSETS, max_tokens=MAX_TOKENS, timeout_s=240)


def run_ten_tasks(hermes_client, run_dir: Path, faults: str = ""):
    """The ten tasks against a fresh server; (task results, recorded exchanges, server alive)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {"FLASHTREE_FAULTS": faults} if faults else {}
    with FlashtreeServer(run_dir / "server.log", "--prefill-ubatch", str(PREFILL_UBATCH),
                         api_key=KEY, env=env) as server, \
            RecordingProxy(server.url, run_dir / "transcript.jsonl") as proxy:
        proxy.label = "hermes"
        results = run_client(hermes_client, Endpoint(proxy.url, server.model(), KEY), run_dir)
        alive = server.alive
    return results, report.load(run_dir / "transcript.jsonl"), alive


def generations(records):
    return [r for r in records if r["path"] == "/v1/chat/completions"]


@pytest.fixture(scope="module")
def clean_run(hermes_client, tmp_path_factory):
    return run_ten_tasks(hermes_client, tmp_path_factory.mktemp("hermes-clean"))


def test_ten_tasks_in_a_row_on_one_server(clean_run):
    results, records, alive = clean_run
    assert alive
    assert [r.returncode for r in results] == [0] * 10, [r.output for r in results]
    chats = generations(records)
    assert len(chats) >= 10
    assert all(r["status"] == 200 for r in records if r["method"] == "POST"), report.summarize(records, "hermes")
    assert not [e for r in chats for e in report.stream_errors(r)]


def test_later_turns_come_from_the_prefix_cache(clean_run):
    usages = [report.usage(r) for r in generations(clean_run[1])]
    assert all(u is not None for u in usages), "hermes asks for usage in its streams"
    later = usages[1:]
    assert sum(u.cached for u in later) > 0.5 * sum(u.prompt for u in later)
    assert sorted(u.cached / u.prompt for u in later)[len(later) // 2] > 0.5


def middle_prefill_visit(records) -> int:
    """The FLASHTREE_FAULTS visit number of the first prefill chunk of the middle request of a
    run like `records` (each request prefills its uncached tokens in PREFILL_UBATCH chunks;
    runs are greedy, so the same tasks make the same requests)."""
    chats = generations(records)
    visits = 0
    for record in chats[:len(chats) // 2]:
        u = report.usage(record)
        visits += math.ceil((u.prompt - u.cached) / PREFILL_UBATCH)
    return visits + 1


def test_one_out_of_memory_in_the_middle_costs_one_retry(hermes_client, clean_run, tmp_path_factory):
    visit = middle_prefill_visit(clean_run[1])
    # the engine retries a failed prefill chunk once (halving the ubatch): fail both attempts
    fault = f"prefill:oom:{visit},prefill:oom:{visit + 1}"
    results, records, alive = run_ten_tasks(hermes_client, tmp_path_factory.mktemp("hermes-oom"), fault)
    assert alive
    assert [r.returncode for r in results] == [0] * 10, [r.output for r in results]
    failed = [r for r in records if r["method"] == "POST" and r["status"] != 200]
    assert len(failed) == 1, report.summarize(records, "hermes")
    error = failed[0]["response"]["error"]
    assert failed[0]["status"] == 503 and error["code"] == "out_of_memory"
    assert "out of memory" in error["message"]
    after = records[records.index(failed[0]) + 1:]
    retry = next(r for r in after if r["method"] == "POST")
    assert retry["path"] == failed[0]["path"] and retry["status"] == 200
