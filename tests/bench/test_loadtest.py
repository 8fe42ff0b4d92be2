"""The load test's client side against a real server on loopback (the tiny random model): a policy's request
fields reach the server (``verify`` asks for lossless verified decoding, whose outputs equal threshold 1.0's),
and the summary lines name every policy and a burst that did not run."""

import asyncio

from serving_fixtures import PROMPTS, loaded, one_thread, start_server  # noqa: F401  (fixtures)

from mars.bench.loadtest import burst_line, run_level, saturation_check


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
