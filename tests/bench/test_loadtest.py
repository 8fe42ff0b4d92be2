"""The load test's client side against a real server on loopback (the tiny random model): a policy's request
fields reach the server (``verify`` asks for lossless verified decoding, whose outputs equal threshold 1.0's),
the summary lines name every policy and a burst that did not run, and every argument out of its range is refused
naming its flag before any server starts."""

import asyncio

import pytest
from serving_fixtures import PROMPTS, loaded, one_thread, start_server  # noqa: F401  (fixtures)

from mars.bench.loadtest import load_prompts, parse_args
from mars.bench.loadtest_client import run_level
from mars.bench.loadtest_report import burst_line, saturation_check


def test_a_verify_level_is_served_verified_and_lossless(loaded):  # noqa: F811
    srv = start_server(loaded)
    try:
        levels = {
            policy: asyncio.run(
                run_level(srv.url, "tiny-random", policy, 1.0, [0.0, 0.05, 0.1], PROMPTS, 0, 12, 60, 60)
            )[0]
            for policy in ("tau1.0", "verify")
        }
    finally:
        srv.stop()
    for policy, results in levels.items():
        assert [r.status for r in results] == [200, 200, 200], [r.error for r in results]
        assert {r.served_verify for r in results} == {policy == "verify"}
        assert all(r.token_ids for r in results)
    assert [r.token_ids for r in levels["verify"]] == [r.token_ids for r in levels["tau1.0"]]


def test_summary_lines_name_verify_and_a_burst_not_run():
    row = dict(achieved_rps=0.5, tokens_per_s=10.0, latency_p95=3.0, agreement_exact=1.0, agreement_prefix=1.0)
    rows = [
        {"policy": "tau1.0", "offered_rps": 1.0, **row},
        {"policy": "verify", "offered_rps": 1.0, **row, "achieved_rps": 0.6, "tokens_per_s": 13.0},
    ]
    text = saturation_check(rows)
    assert "At that load verify completes 1.20x the requests/s (1.30x the tokens/s)" in text
    assert "identical to tau=1.0's for 100%" in text
    # saturation is judged against what arrived: 15 requests in 30 s is 0.5 per second, which 0.5 keeps up with
    arrived = [{**r, "requests": 15} for r in rows]
    assert saturation_check(arrived, duration=30).startswith("tau=1.0 kept up with every level")
    assert "saturates at an offered 1 req/s (0.67 arrived" in saturation_check(
        [{**r, "requests": 20} for r in rows], duration=30
    )
    assert burst_line({}, 8).startswith("Burst: not run")
    burst = burst_line({"requests": 32, "codes": {"200": 16, "429": 16}}, 8)
    assert burst.startswith("Burst: 32 simultaneous requests (4x max_queue=8)")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rates", "-1"], "--rates: -1.0 is not an offered load"),
        (["--rates", "0"], "--rates: 0.0 is not an offered load"),
        (["--rates", "nan"], "--rates: nan is not an offered load"),
        (["--rates", "inf"], "--rates: inf is not an offered load"),
        (["--rates", "1e9"], r"each rate must be in \(0, 100\]"),
        (["--rates", "0.3,0.1"], "--rates must increase"),
        (["--rates", "0.1,0.1"], "--rates must increase"),
        (["--duration", "1e12"], r"--duration must be in \(0, 3600\]"),
        (["--duration", "nan"], "--duration must be in"),
        (["--duration", "0"], "--duration must be in"),
        (["--rates", "90", "--duration", "100"], "offers about 9000 requests in one level"),
        (["--level-limit", "-1"], "--level-limit must be in"),
        (["--duration", "40", "--level-limit", "10"], "--level-limit 10 is shorter than --duration 40"),
        (["--timeout", "0"], "--timeout must be in"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
        (["--max-tokens", "-3"], "--max-tokens must be >= 1, got -3"),
        (["--max-batch", "0"], "--max-batch must be >= 1, got 0"),
        (["--max-prompt-tokens", "0"], "--max-prompt-tokens must be >= 1"),
        (["--burst-max-tokens", "0"], "--burst-max-tokens must be >= 1"),
        (["--max-queue", "0"], "--max-queue 0 leaves the burst"),
        (["--threshold-min", "0"], r"--threshold-min must be in \(0, 1\]"),
        (["--target-queue", "-2"], "--target-queue must be a positive number"),
        (["--max-step-columns", "0"], "--max-step-columns takes an integer >= 1, null or auto"),
        (["--policies", "tau1.0,verify,tau1.0"], r"--policies names \['tau1.0'\] more than once"),
    ],
)
def test_every_argument_out_of_range_is_refused_naming_its_flag(argv, message):
    with pytest.raises(SystemExit, match=message):
        parse_args(argv)


def test_arguments_in_range_pass_and_step_columns_take_serve_values():
    args = parse_args(["--rates", "0.1,0.3", "--duration", "20", "--max-step-columns", "None", "--no-burst"])
    assert args.rates == [0.1, 0.3] and args.policies == ["tau1.0", "tau0.9", "adaptive"]
    assert args.max_step_columns == "null"  # Hydra's null: no cap
    assert parse_args(["--max-step-columns", "8"]).max_step_columns == "8"
    assert parse_args([]).max_step_columns is None  # serve.yaml's default


def test_a_prompt_limit_no_prompt_meets_is_refused_with_the_shortest_length(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Say hi."}\n{"prompt": "Name three rivers in Europe."}\n')
    kept = load_prompts(prompts, 10_000, limit=5)
    assert kept == ["Say hi.", "Name three rivers in Europe."]
    with pytest.raises(SystemExit, match=r"--max-prompt-tokens 1: no prompt .*the shortest is (\d+) tokens") as err:
        load_prompts(prompts, 1, limit=5)
    shortest = int(str(err.value).split("use --max-prompt-tokens ")[1].split()[0])
    assert load_prompts(prompts, shortest, limit=5) == ["Say hi."]
    prompts.write_text('{"prompt": "Hi."}\n{"text": "no prompt"}\n')
    with pytest.raises(
        SystemExit, match=r"--prompts .*p.jsonl, line 2: no prompt \(expected a non-empty 'prompt' string"
    ):
        load_prompts(prompts, 10_000, limit=5)


def test_the_servers_start_from_the_package_in_any_folder(tmp_path):
    """The server is ``mars-serve``'s module entry point in this interpreter (in a checkout and an installed wheel
    alike), run from any folder; the default prompts are the package's held-out set wherever it keeps its data."""
    import subprocess

    from mars.bench.loadtest_client import SERVE
    from mars.paths import data_dir

    proc = subprocess.run([*SERVE, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "mars-serve" in proc.stdout.splitlines()[0] and "tau_policy" in proc.stdout
    args = parse_args([])
    assert args.prompts == str(data_dir() / "prompts" / "heldout.jsonl") and len(load_prompts(args.prompts, 96, 3)) == 3


@pytest.mark.slow
def test_a_load_test_runs_end_to_end_from_another_folder(tmp_path, monkeypatch):
    """One policy, one short level and the burst against a real ``mars-serve`` subprocess of the tiny model, run
    from a folder outside any checkout: every request answered, the tables written."""
    import csv

    from mars.bench.loadtest import main

    monkeypatch.chdir(tmp_path)
    args = ["--model", "tiny-random", "--policies", "tau1.0", "--rates", "2", "--duration", "3", "--level-limit", "60"]
    main([*args, "--max-tokens", "4", "--max-queue", "2", "--burst-max-tokens", "2", "--out", "lt"])
    levels = list(csv.DictReader((tmp_path / "lt" / "levels.csv").open()))
    assert [row["policy"] for row in levels] == ["tau1.0"] and levels[0]["completed"] == levels[0]["requests"] == "5"
    assert levels[0]["failed"] == "0" and levels[0]["agreement_exact"] == "1.0"
    assert "Burst: 8 simultaneous requests" in (tmp_path / "lt" / "table.md").read_text()
    assert (tmp_path / "lt" / "server_logs" / "tau1.0" / "server.log").is_file()


@pytest.mark.slow  # a real server start: about 17 s
def test_a_load_test_killed_with_sigterm_stops_its_servers(tmp_path):
    """``kill`` on a running load test (SIGTERM, as a job scheduler sends it) stops the ``mars-serve`` it started
    rather than leaving it serving on a loopback port."""
    import os
    import signal
    import subprocess
    import sys

    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from mars.bench.loadtest_client import ServerProcess, servers_stopped_on_exit\n"
        "servers = {'tau1.0': ServerProcess(['model=tiny-random'], Path(sys.argv[1]))}\n"
        "with servers_stopped_on_exit(servers):\n"
        "    servers['tau1.0'].wait_ready(120)\n"
        "    print(servers['tau1.0'].proc.pid, flush=True)\n"
        "    time.sleep(600)\n"
    )
    client = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    server_pid = int(client.stdout.readline())
    os.kill(server_pid, 0)  # the server is up
    client.send_signal(signal.SIGTERM)
    assert client.wait(90) == 128 + signal.SIGTERM
    with pytest.raises(ProcessLookupError):
        os.kill(server_pid, 0)
