"""The proof rules of the collective checks (comm/diagnosis.py), on hand-written reports: a
divergence is proven only by two different fingerprints at one sequence number, or by one where
a rank that reached the check issued none; a rank that is merely waiting proves nothing (it may
be slow, or waiting for a third rank). No world is started."""

import torch

from shardwise.comm.diagnosis import diagnose_reports
from shardwise.comm.fingerprint import fingerprint

G = "dp:0,1,2"
AR4 = "all_reduce(dp, grad, float32[4])"


def report(rank, ops, label=None, waiting=None, base=0):
    """A full report: ``ops`` the fingerprints this rank issued on G since the last check;
    ``label`` set = it reached the check (final), else it waits ``waiting``."""
    return {"rank": rank, "label": label, "waiting": waiting,
            "groups": {G: {"base": base, "members": [0, 1, 2],
                           "ops": [[fp, "step", 3, base + i + 1] for i, fp in enumerate(ops)]}},
            "member_of": {G: [0, 1, 2]}}


def test_fingerprint_text():
    assert fingerprint("all_reduce", "tp", "grad", torch.empty(4096)) == \
        "all_reduce(tp, grad, float32[4096])"
    assert fingerprint("reduce_scatter", "dp", "", torch.empty(2, 3, dtype=torch.bfloat16),
                       reduce="avg") == "reduce_scatter(dp, -, bfloat16[2,3], avg)"
    assert fingerprint("broadcast_object", "world", "run", None, src=0) == \
        "broadcast_object(world, run, src=0)"


def test_different_fingerprints_at_one_sequence_number_are_proof():
    other = "all_gather(dp, param, float32[12])"
    msg = diagnose_reports({0: report(0, [AR4, AR4], waiting="in x"),
                              1: report(1, [AR4, other], waiting="in y"),
                              2: report(2, [AR4, AR4], waiting="in x")})
    assert msg.startswith(f"rank 1 called {other} where ranks 0,2 called {AR4}, at collective "
                          f"#2 on dp (ranks 0,1,2) in step 3: "), msg


def test_an_extra_collective_is_proven_only_against_a_rank_at_the_check():
    extra = [AR4, "all_reduce(dp, extra, float32[4])"]
    stuck = report(1, extra, waiting="in all_reduce")
    # the others merely wait (elsewhere): nothing is proven
    assert diagnose_reports({0: report(0, [AR4], waiting="in tp"), 1: stuck}) is None
    # rank 0 reached the check with one collective: rank 1's second is proven extra
    msg = diagnose_reports({0: report(0, [AR4], label="before step 4"), 1: stuck})
    assert msg.startswith("rank 1 called all_reduce(dp, extra, float32[4]) where rank 0 issued "
                          "no collective (reached the check before step 4), at collective #2 "
                          "on dp (ranks 0,1,2) in step 3"), msg


def test_sequence_numbers_count_from_the_group_start():
    msg = diagnose_reports({0: report(0, [], label="before step 4", base=340),
                              1: report(1, [AR4], waiting="in all_reduce", base=340)})
    assert "at collective #341 on dp" in msg, msg


def test_agreeing_reports_prove_nothing():
    assert diagnose_reports({r: report(r, [AR4, AR4], label="before step 4")
                               for r in range(3)}) is None
