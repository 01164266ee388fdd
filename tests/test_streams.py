"""Stream builders: domain order, block sizes, transition rates, MD-Long runs, segments, seeds;
the definitions of the module's docstring at their edges, and the orders of this version."""
import collections
import hashlib

import pytest

from tta_brain.data import streams
from tta_brain.data.manifest import STREAM_COLUMNS, validate_manifest, write_manifest
from tta_brain.data.streams import (LS_C_DOMAINS, MD_EASY_ORDER, MD_HARD_ORDER, boundaries,
                                    build_stream, md_long, multi_domain, random_order, runs,
                                    single_domain)


def make_domains(n=600, domains=LS_C_DOMAINS):
    return {d: [{"ID": f"u{i:04d}_{d}", "duration": 1.0, "wav": f"/x/{d}/{i}.wav",
                 "spk_id": "s", "wrd": "A", "source_id": f"u{i:04d}"} for i in range(n)]
            for d in domains}


def check_positions_and_segments(stream):
    assert [r["position"] for r in stream] == list(range(len(stream)))
    for prev, cur in zip(stream, stream[1:]):
        changed = prev["domain"] != cur["domain"]
        # segment changes exactly at the true domain boundaries
        assert cur["segment"] == prev["segment"] + (1 if changed else 0)
    assert stream[0]["segment"] == 0


@pytest.mark.parametrize("name,order", [("md_easy", MD_EASY_ORDER), ("md_hard", MD_HARD_ORDER)])
def test_md_easy_hard_paper_sizes(name, order):
    stream = build_stream(name, make_domains(), seed=0)
    assert len(stream) == 2500
    check_positions_and_segments(stream)
    assert runs(stream) == [(d, 500 * i, 500) for i, d in enumerate(order)]
    assert boundaries(stream) == [500, 1000, 1500, 2000]
    for d in order:
        ids = [r["ID"] for r in stream if r["domain"] == d]
        assert len(set(ids)) == 500  # no repeats inside a domain
        assert all(i.endswith("_" + d) for i in ids)


def test_each_domain_has_its_own_shuffle():
    stream = build_stream("md_easy", make_domains(), seed=0)
    order_of = {d: [r["source_id"] for r in stream if r["domain"] == d] for d in MD_EASY_ORDER}
    assert order_of["AC"] != order_of["CM"]
    assert order_of["AC"] != sorted(order_of["AC"])  # shuffled


@pytest.mark.parametrize("name,rate,order", [
    ("md_easy_s100", 100, MD_EASY_ORDER), ("md_easy_s20", 20, MD_EASY_ORDER),
    ("md_hard_s100", 100, MD_HARD_ORDER), ("md_hard_s20", 20, MD_HARD_ORDER)])
def test_transition_rates_cycle_the_order(name, rate, order):
    doms = make_domains()
    stream = build_stream(name, doms, seed=3)
    assert len(stream) == 2500
    check_positions_and_segments(stream)
    blocks = runs(stream)
    assert len(blocks) == 2500 // rate
    assert [b[0] for b in blocks] == list(order) * (500 // rate)
    assert all(length == rate for _, _, length in blocks)
    assert boundaries(stream) == list(range(rate, 2500, rate))
    # the same 500 utterances per domain as s=500, in the same per-domain order
    base = build_stream(name.split("_s")[0], doms, seed=3)
    for d in order:
        assert [r["ID"] for r in stream if r["domain"] == d] == \
            [r["ID"] for r in base if r["domain"] == d]


def test_md_long_paper_sizes():
    doms = make_domains(n=3000)
    stream = build_stream("md_long", doms, seed=7)
    assert len(stream) == 10000
    check_positions_and_segments(stream)
    blocks = runs(stream)
    for domain, _, length in blocks[:-1]:
        assert 20 <= length <= 500
    assert 1 <= blocks[-1][2] <= 500
    for (d1, _, _), (d2, _, _) in zip(blocks, blocks[1:]):
        assert d1 != d2  # never the same domain twice in a row
    assert {b[0] for b in blocks} == set(LS_C_DOMAINS)
    # without replacement within a domain while its pool lasts (3000 > what any domain gets)
    per_domain = collections.defaultdict(list)
    for r in stream:
        per_domain[r["domain"]].append(r["ID"])
    for d, ids in per_domain.items():
        assert len(ids) == len(set(ids)), d
    # lengths spread over the range (uniform in [20, 500]): mean near 260
    lengths = [b[2] for b in blocks[:-1]]
    assert 180 < sum(lengths) / len(lengths) < 340


def test_md_long_refills_pool_only_when_exhausted():
    doms = make_domains(n=30, domains=("A", "B"))
    stream = md_long(doms, total=200, min_len=5, max_len=40, seed=1)
    assert len(stream) == 200
    for d in "AB":
        ids = [r["ID"] for r in stream if r["domain"] == d]
        for start in range(0, len(ids) - 30 + 1, 30):
            assert len(set(ids[start:start + 30])) == 30  # each pass uses every utterance once
    names = [b[0] for b in runs(stream)]
    assert all(x != y for x, y in zip(names, names[1:]))  # two domains: strict alternation


@pytest.mark.timeout(60)      # an empty domain would be drawn from for ever
def test_md_long_stops_exactly_and_validates():
    stream = md_long(make_domains(n=50), total=123, min_len=20, max_len=30, seed=0)
    assert len(stream) == 123
    with pytest.raises(ValueError, match="two domains"):
        md_long(make_domains(n=5, domains=("A",)), total=10)
    with pytest.raises(ValueError, match="min_len"):
        md_long(make_domains(n=5), total=10, min_len=5, max_len=2)
    with pytest.raises(streams.MissingDomain, match="no utterances for domain 'B'"):
        md_long({"A": make_domains(n=5)["AC"], "B": []}, total=10, min_len=2, max_len=3)
    for total in (0, -5):             # was an empty stream, written as a manifest with no header
        with pytest.raises(ValueError, match=f"md_long: total must be >= 1, got {total}"):
            md_long(make_domains(n=5), total=total)


def test_streams_are_reproducible_and_seed_dependent():
    doms = make_domains(n=200)
    for name in ("md_long", "md_hard_s20", "AC"):
        kw = {"total": 1000, "min_len": 5, "max_len": 50} if name == "md_long" else \
            ({"per_domain": 100} if name.startswith("md") else {})
        a = build_stream(name, doms, seed=11, **kw)
        b = build_stream(name, dict(reversed(list(doms.items()))), seed=11, **kw)  # dict order
        c = build_stream(name, doms, seed=12, **kw)
        assert [r["ID"] for r in a] == [r["ID"] for r in b]
        assert [r["ID"] for r in a] != [r["ID"] for r in c]


def test_scaled_down_presets_keep_cycles():
    doms = make_domains(n=60)
    s100 = build_stream("md_easy_s100", doms, per_domain=50)  # 5 cycles of 10
    assert [b[2] for b in runs(s100)] == [10] * 25
    s20 = build_stream("md_hard_s20", doms, per_domain=50)  # 25 cycles of 2
    assert [b[2] for b in runs(s20)] == [2] * 125
    with pytest.raises(ValueError, match="multiple of 25"):
        build_stream("md_hard_s20", doms, per_domain=30)
    explicit = build_stream("md_easy_s20", doms, per_domain=30, rate=10)
    assert [b[2] for b in runs(explicit)] == [10] * 15


def test_single_domain_and_random_order():
    doms = make_domains(n=40)
    s = single_domain(doms["GS"], seed=0, domain="GS")
    check_positions_and_segments(s)
    assert {r["segment"] for r in s} == {0} and {r["domain"] for r in s} == {"GS"}
    assert sorted(r["ID"] for r in s) == sorted(r["ID"] for r in doms["GS"])
    assert [r["ID"] for r in s] != [r["ID"] for r in doms["GS"]]
    rows = [dict(r, domain=split) for split, code in
            (("bus_real", "AA"), ("caf_simu", "AC"), ("ped_simu", "BA")) for r in doms[code][:10]]
    r = random_order(rows, seed=0)
    check_positions_and_segments(r)
    assert sorted(x["ID"] + x["domain"] for x in r) == sorted(x["ID"] + x["domain"] for x in rows)
    assert len(runs(r)) > 3  # mixed order
    with pytest.raises(ValueError, match="domain"):
        random_order([{"ID": "a"}])


def test_consecutive_blocks_of_one_domain_form_one_segment():
    s = multi_domain(make_domains(n=10, domains=("A", "B")), order=("A",), per_domain=8, rate=2)
    assert {r["segment"] for r in s} == {0}
    assert boundaries(s) == []


def test_errors_name_the_problem():
    doms = make_domains(n=10)
    with pytest.raises(ValueError, match="AC.*fewer than per_domain"):
        build_stream("md_easy", doms)
    with pytest.raises(ValueError, match="no utterances for domain 'ZZ'"):
        multi_domain(doms, order=("ZZ",), per_domain=5)
    with pytest.raises(ValueError, match="unknown stream"):
        build_stream("md_medium", doms)
    with pytest.raises(TypeError, match="does not take"):
        build_stream("md_easy", doms, total=5)
    with pytest.raises(ValueError, match="multiple"):
        multi_domain(doms, order=("AC",), per_domain=10, rate=3)


def test_too_few_utterances_says_what_size_fits():
    doms = make_domains(n=59)
    with pytest.raises(streams.TooFewUtterances) as err:
        build_stream("md_easy", doms)
    assert str(err.value) == ("multi_domain: domain 'AC' has 59 utterances, fewer than "
                              "per_domain=500; lower per_domain to 59 or less")
    with pytest.raises(streams.TooFewUtterances, match="lower per_domain to 50 or less "
                       r"\(a multiple of 25, the 25 cycles through the order\)"):
        build_stream("md_easy_s20", doms)
    with pytest.raises(streams.TooFewUtterances, match="to 50 or less .a multiple of 10, the "
                       "transition rate"):
        build_stream("md_easy_s20", doms, per_domain=60, rate=10)
    with pytest.raises(streams.TooFewUtterances, match="needs at least 25 utterances per domain "
                       r"\(the 25 cycles through the order\) and the smallest domain has 20"):
        build_stream("md_easy_s20", make_domains(n=20))
    with pytest.raises(streams.MissingDomain):
        build_stream("md_easy", make_domains(n=600, domains=("AC",)))


def test_filter_by_duration():
    rows = [{"ID": str(i), "duration": d} for i, d in enumerate((5.0, 20.0, 20.01, 35.0))]
    assert [r["ID"] for r in streams.filter_by_duration(rows, 20)] == ["0", "1"]
    assert len(streams.filter_by_duration(rows, None)) == 4


def test_stream_manifest_roundtrip_validates(tmp_path):
    stream = build_stream("md_easy_s20", make_domains(n=60), per_domain=50, seed=0)
    path = write_manifest(tmp_path / "s.csv", stream)
    rows = validate_manifest(path, required=STREAM_COLUMNS)
    assert [r["ID"] for r in rows] == [r["ID"] for r in stream]
    header = path.read_text().splitlines()[0].split(",")
    assert header[:8] == list(STREAM_COLUMNS) and "source_id" in header


# ------------------------------------------------- the definitions at their edges (mutation audit)
def pools(n, domains=("AC", "CM", "TP", "AA", "SD", "GS", "MU", "VC", "BA", "NB")):
    # every domain mixed from the same clean utterances, listed in the same order (as LS-C is)
    return {d: [{"ID": f"u{i:03d}_{d}", "source_id": f"u{i:03d}", "domain": d} for i in range(n)]
            for d in domains}


def ids(stream):
    return [r["ID"] for r in stream]


def test_a_domain_with_exactly_per_domain_utterances_is_enough():
    doms = pools(50)
    stream = build_stream("md_hard", doms, per_domain=50, seed=0)
    assert [(d, n) for d, _, n in runs(stream)] == [(d, 50) for d in ("GS", "MU", "VC", "BA", "NB")]
    assert multi_domain(doms, order=("AC", "CM"), per_domain=50, rate=10)


def test_md_long_run_lengths_reach_both_ends_of_the_range():
    # "a run length uniformly in [min_len, max_len]": both ends are lengths
    assert [n for _, _, n in runs(md_long(pools(40), total=30, min_len=5, max_len=5))] == [5] * 6
    lengths = [n for _, _, n in runs(md_long(pools(40), total=3000, min_len=1, max_len=3,
                                             seed=2))][:-1]
    assert set(lengths) == {1, 2, 3}


def test_md_long_refuses_runs_shorter_than_one():
    with pytest.raises(ValueError, match="min_len"):
        md_long(pools(10), total=20, min_len=0, max_len=3)


def test_single_domain_needs_one_domain_value():
    rows = [{"ID": f"u{i}"} for i in range(5)]          # no domain column, no domain=
    with pytest.raises(ValueError, match="pass domain="):
        single_domain(rows)
    assert {r["domain"] for r in single_domain(rows, domain="AC")} == {"AC"}


def test_every_builder_ignores_the_order_of_the_input_dict():
    doms = pools(40)
    back = dict(reversed(list(doms.items())))
    for name, kw in (("random", {}), ("md_long", {"total": 200, "min_len": 5, "max_len": 30}),
                     ("md_easy_s20", {"per_domain": 25}), ("GS", {})):
        assert ids(build_stream(name, doms, seed=4, **kw)) == \
            ids(build_stream(name, back, seed=4, **kw)), name


def test_each_single_domain_stream_is_its_own_shuffle():
    # the domains hold the same clean utterances in the same order: with one shuffle for all,
    # every single-domain stream would present the same sentences in the same order
    doms = pools(40)
    orders = {d: [r["source_id"] for r in build_stream(d, doms, seed=0)]
              for d in ("AC", "CM", "GS")}
    assert orders["AC"] != orders["CM"] != orders["GS"] != orders["AC"]


#: sha1 of the ID sequence of each stream of ``pools(60)`` (seed 5): the orders of this version.
#: A change here changes every stream prepared from now on (and so every result on it).
PINNED = {
    "AC": "92811bb3db364d69bc82b954c37d341ece32e242",
    "random": "50d432dc06c61a08ebed4d558d21b768b4e34efb",
    "md_easy": "e35bb97ab4f45ce680fb1182969dede976395451",
    "md_hard_s20": "513b924d128a7e7b5a7cbb99ca0532799e891006",
    "md_long": "cc9920785d83f329084e5131e1630df93e3777f0",
}


@pytest.mark.parametrize("name,kw", [
    ("AC", {}), ("random", {}), ("md_easy", {"per_domain": 60}),
    ("md_hard_s20", {"per_domain": 50}),
    ("md_long", {"total": 300, "min_len": 5, "max_len": 40})])
def test_stream_orders_are_those_of_this_version(name, kw):
    order = ",".join(ids(build_stream(name, pools(60), seed=5, **kw)))
    got = hashlib.sha1(order.encode()).hexdigest()
    assert got == PINNED[name], name
