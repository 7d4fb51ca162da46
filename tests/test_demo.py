"""`make demo` runs, checks itself against the oracle, and prints the balance the theory predicts."""

from sim import demo


def test_demo_runs_and_reports(capsys):
    assert demo.main([]) == 0
    out = capsys.readouterr().out
    P = demo.P
    # contiguous: rank r does (r + 1) c^2 per document, so max/mean = 2P / (P + 1); zigzag: 1
    assert f"imbalance (max/mean work) = {2 * P / (P + 1):.3f}" in out
    assert "imbalance (max/mean work) = 1.000" in out
    assert "mode=all_gather layout=zigzag" in out and "mode=all_gather layout=contiguous" in out
    assert "within 1e-10" in out
