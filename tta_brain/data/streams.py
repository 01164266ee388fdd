"""Test streams: seeded, reproducible orderings of utterances over domains (pure functions).

Every builder takes utterance rows (dicts, e.g. from :func:`~tta_brain.data.manifest.read_manifest`)
and returns new row dicts in stream order with three added fields:

- ``domain``: the domain of the utterance;
- ``segment``: index of the contiguous domain block (0, 1, ...); it changes exactly where the domain
  changes, i.e. at the true boundaries;
- ``position``: 0-based index in the stream.

Streams of the paper (LS-C, 10 noise domains at 5 dB):

- single domain: one domain's utterances in a seeded random order (10 streams);
- MD-Easy AC->CM->TP->AA->SD and MD-Hard GS->MU->VC->BA->NB: 500 utterances per domain, each domain
  its own shuffle, boundaries at 500, 1000, 1500, 2000. With transition rate ``s`` (100, 20) the
  same order is cycled in blocks of ``s`` (the i-th block of a domain takes utterances
  ``i*s..(i+1)*s-1`` of that domain's shuffle), keeping 2500 utterances; this is what the official
  code does;
- MD-Long: pick a domain uniformly among all except the previous one, a run length uniformly in
  [20, 500], repeat until 10,000 utterances; the last run is cut so the total is exact (it may then
  be shorter than 20). Utterances are drawn without replacement per domain over the whole stream;
  a domain's pool is refilled (reshuffled) only when it is exhausted. (The official code samples
  without replacement only within a run, so an utterance may recur in a later run of the same
  domain even before the pool is used up.)
- CHiME-3: all utterances in one seeded random order (:func:`random_order`).

Randomness comes from ``numpy.random.default_rng`` seeded with the stream seed (and a stable hash of
the domain name for per-domain shuffles), so streams do not depend on ``PYTHONHASHSEED`` or on the
order of the input dict.
"""
import zlib

import numpy as np

MD_EASY_ORDER = ("AC", "CM", "TP", "AA", "SD")
MD_HARD_ORDER = ("GS", "MU", "VC", "BA", "NB")
LS_C_DOMAINS = ("AA", "AC", "BA", "CM", "GS", "MU", "NB", "SD", "TP", "VC")

#: Named streams. ``kind`` selects the builder; the other keys are its default sizes, which
#: :func:`build_stream` lets callers override (the synthetic recipe uses scaled-down sizes).
#: When ``per_domain`` is overridden but ``rate`` is not, the rate is scaled to keep the number of
#: cycles through the order (s=100: 5 cycles, s=20: 25 cycles).
PRESETS = {
    "md_easy": dict(kind="multi_domain", order=MD_EASY_ORDER, per_domain=500, rate=None),
    "md_easy_s100": dict(kind="multi_domain", order=MD_EASY_ORDER, per_domain=500, rate=100),
    "md_easy_s20": dict(kind="multi_domain", order=MD_EASY_ORDER, per_domain=500, rate=20),
    "md_hard": dict(kind="multi_domain", order=MD_HARD_ORDER, per_domain=500, rate=None),
    "md_hard_s100": dict(kind="multi_domain", order=MD_HARD_ORDER, per_domain=500, rate=100),
    "md_hard_s20": dict(kind="multi_domain", order=MD_HARD_ORDER, per_domain=500, rate=20),
    "md_long": dict(kind="md_long", total=10000, min_len=20, max_len=500),
    "random": dict(kind="random_order"),
}


class MissingDomain(ValueError):
    """A stream needs a domain that the inputs do not have (its noisy set was not made)."""


class TooFewUtterances(ValueError):
    """A domain has fewer utterances than ``per_domain``.

    ``smallest`` is the fewest utterances of any domain of the stream and ``step`` what
    ``per_domain`` must be a multiple of, so ``fit`` is the largest size every domain has.
    """

    def __init__(self, domain, count, per_domain, smallest, step=1, why=""):
        self.domain, self.count, self.per_domain = domain, count, per_domain
        self.smallest, self.step, self.why = smallest, step, why
        super().__init__(f"multi_domain: domain {domain!r} has {count} utterances, fewer than "
                         f"per_domain={per_domain}; {self.advice('per_domain')}")

    @property
    def fit(self):
        return self.smallest // self.step * self.step

    def advice(self, option):
        """What to do, naming the size option as ``option`` (e.g. ``--per_domain``)."""
        why = f" ({self.why})" if self.why else ""
        if not self.fit:
            return (f"this stream needs at least {self.step} utterances per domain{why} and the "
                    f"smallest domain has {self.smallest}: leave the stream out")
        multiple = f" (a multiple of {self.step}{', ' + self.why if self.why else ''})" \
            if self.step > 1 else ""
        return f"lower {option} to {self.fit} or less{multiple}"


def _rng(seed, *keys):
    """A generator seeded by ``seed`` and stable hashes of ``keys``."""
    entropy = [int(seed)] + [zlib.crc32(str(k).encode("utf-8")) for k in keys]
    return np.random.default_rng(entropy)


def _shuffled(rows, rng):
    rows = list(rows)
    return [rows[i] for i in rng.permutation(len(rows))]


def _assemble(blocks):
    """Concatenate ``(domain, rows)`` blocks into stream rows with domain, segment and position.

    Consecutive blocks of the same domain form one segment: ``segment`` changes only at a true
    domain change.
    """
    stream, segment, prev = [], -1, object()
    for domain, rows in blocks:
        if domain != prev:
            segment += 1
            prev = domain
        for row in rows:
            out = dict(row)
            out["domain"] = domain
            out["segment"] = segment
            out["position"] = len(stream)
            stream.append(out)
    return stream


def single_domain(rows, seed=0, domain=None, shuffle=True):
    """One domain in a seeded random order (or the given order with ``shuffle=False``).

    ``domain`` defaults to the rows' own ``domain`` value, which must then be the same for all rows.
    """
    rows = list(rows)
    if not rows:
        raise ValueError("single_domain: no utterances")
    if domain is None:
        domains = {r.get("domain") for r in rows}
        if len(domains) != 1 or None in domains:
            raise ValueError("single_domain: pass domain= (rows have no single domain value)")
        domain = domains.pop()
    if shuffle:
        rows = _shuffled(rows, _rng(seed, domain))
    return _assemble([(domain, rows)])


def multi_domain(domain_rows, order, per_domain=500, rate=None, seed=0):
    """MD-Easy / MD-Hard style stream over ``order`` (see the module docstring).

    ``domain_rows`` maps each domain to its utterances. Each domain is shuffled with its own
    generator and its first ``per_domain`` utterances are used. ``rate`` (the transition rate s)
    splits them into blocks of ``rate`` that cycle through ``order``; ``None`` means one block per
    domain. ``per_domain`` must be a multiple of ``rate``.
    """
    order = list(order)
    rate = per_domain if rate is None else int(rate)
    if rate <= 0 or per_domain <= 0:
        raise ValueError("multi_domain: per_domain and rate must be positive")
    if per_domain % rate:
        raise ValueError(f"multi_domain: per_domain={per_domain} is not a multiple of rate={rate}")
    for domain in order:
        if domain not in domain_rows:
            raise MissingDomain(f"multi_domain: no utterances for domain {domain!r} "
                                f"(have: {', '.join(sorted(domain_rows))}; this stream's domains: "
                                f"{', '.join(order)})")
    short = [d for d in order if len(domain_rows[d]) < per_domain]
    if short:
        raise TooFewUtterances(short[0], len(domain_rows[short[0]]), per_domain,
                               min(len(domain_rows[d]) for d in order),
                               step=rate if rate < per_domain else 1,
                               why="the transition rate" if rate < per_domain else "")
    pools = {}
    for domain in order:
        pools[domain] = _shuffled(domain_rows[domain], _rng(seed, domain))[:per_domain]
    blocks = []
    for cycle in range(per_domain // rate):
        for domain in order:
            blocks.append((domain, pools[domain][cycle * rate:(cycle + 1) * rate]))
    return _assemble(blocks)


def md_long(domain_rows, total=10000, min_len=20, max_len=500, seed=0, domains=None):
    """MD-Long stream (see the module docstring): random domain runs until ``total`` utterances.

    ``domains`` restricts/orders the candidate domains (default: all keys, sorted). A domain with
    fewer utterances than a run gets its pool refilled within that run.
    """
    domains = sorted(domain_rows) if domains is None else list(domains)
    if len(domains) < 2:
        raise ValueError("md_long: needs at least two domains (a domain never follows itself)")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"md_long: need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    if total < 1:
        raise ValueError(f"md_long: total must be >= 1, got {total}")
    for domain in domains:
        if not domain_rows.get(domain):
            raise MissingDomain(f"md_long: no utterances for domain {domain!r} (have: "
                             f"{', '.join(sorted(d for d in domain_rows if domain_rows[d]))}; "
                                f"this stream's domains: {', '.join(domains)})")
    rng = _rng(seed, "md_long")
    pools = {d: [] for d in domains}
    blocks, count, prev = [], 0, None
    while count < total:
        candidates = [d for d in domains if d != prev]
        domain = candidates[int(rng.integers(len(candidates)))]
        length = min(int(rng.integers(min_len, max_len + 1)), total - count)
        taken = []
        while len(taken) < length:
            if not pools[domain]:
                pools[domain] = _shuffled(domain_rows[domain], rng)
            need = length - len(taken)
            taken.extend(pools[domain][:need])
            pools[domain] = pools[domain][need:]
        blocks.append((domain, taken))
        count += length
        prev = domain
    return _assemble(blocks)


def random_order(rows, seed=0):
    """All ``rows`` in one seeded random order; ``domain`` comes from each row (CHiME-3 splits).

    Segments follow the domain changes of the resulting order.
    """
    rows = list(rows)
    if not rows:
        raise ValueError("random_order: no utterances")
    if any(not r.get("domain") for r in rows):
        raise ValueError("random_order: every row needs a 'domain' value")
    rows = _shuffled(rows, _rng(seed, "random_order"))
    return _assemble([(r["domain"], [r]) for r in rows])


def build_stream(name, domain_rows, seed=0, **overrides):
    """Build the stream called ``name``.

    ``name`` is a preset (:data:`PRESETS`) or a domain of ``domain_rows`` (single-domain stream).
    ``overrides`` replace the preset's sizes (``per_domain``, ``rate``, ``order``, ``total``,
    ``min_len``, ``max_len``, ``domains``); unknown keys raise ``TypeError``. A stream whose domain
    is not in ``domain_rows`` raises :class:`MissingDomain`, one with too few utterances per domain
    :class:`TooFewUtterances` (both are ``ValueError``).
    """
    if name in PRESETS:
        params = dict(PRESETS[name])
        allowed = set(params) | ({"domains"} if params["kind"] == "md_long" else set())
        unknown = set(overrides) - allowed
        if unknown:
            raise TypeError(f"stream {name!r} does not take {', '.join(sorted(unknown))}")
        cycles = 1
        if params.get("rate") and "rate" not in overrides:
            cycles = params["per_domain"] // params["rate"]
            if "per_domain" in overrides and overrides["per_domain"] % cycles:
                below = overrides["per_domain"] // cycles * cycles
                example = f"{below} or {below + cycles}" if below else f"{cycles}"
                raise ValueError(f"stream {name!r} cycles {cycles} times through its order: "
                                 f"per_domain={overrides['per_domain']} must be a multiple of "
                                 f"{cycles} (e.g. {example})")
            if "per_domain" in overrides:
                params["rate"] = overrides["per_domain"] // cycles
        params.update(overrides)
        kind = params.pop("kind")
        if kind == "multi_domain":
            try:
                return multi_domain(domain_rows, seed=seed, **params)
            except TooFewUtterances as e:
                if cycles == 1:
                    raise
                # a smaller per_domain keeps the cycles (the rate follows): a multiple of them
                raise TooFewUtterances(e.domain, e.count, e.per_domain, e.smallest, step=cycles,
                                       why=f"the {cycles} cycles through the order") from None
        if kind == "md_long":
            return md_long(domain_rows, seed=seed, **params)
        return random_order([r for d in sorted(domain_rows) for r in domain_rows[d]], seed=seed)
    if name in domain_rows:
        if overrides:
            raise TypeError(f"single-domain stream {name!r} takes no size options")
        return single_domain(domain_rows[name], seed=seed, domain=name)
    raise MissingDomain(f"unknown stream {name!r}: use a domain ({', '.join(sorted(domain_rows))}) "
                        f"or a preset ({', '.join(PRESETS)})")


def group_by_domain(rows):
    """``{domain: [rows]}`` from rows with a ``domain`` column (input order kept)."""
    groups = {}
    for row in rows:
        groups.setdefault(row["domain"], []).append(row)
    return groups


def filter_by_duration(rows, max_duration=None):
    """Rows with ``duration <= max_duration`` seconds (all rows if ``max_duration`` is falsy).

    The official code drops utterances longer than 20 s before building LS-C streams, so every
    position of a stream is decoded.
    """
    if not max_duration:
        return list(rows)
    kept = []
    for r in rows:
        try:
            seconds = float(r["duration"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"utterance {r.get('ID', '?')}: duration {r.get('duration')!r} is "
                             "no number of seconds, which max_duration needs (a manifest "
                             "without durations: leave max_duration out)") from None
        if seconds <= float(max_duration):
            kept.append(r)
    return kept


def runs(stream):
    """``[(domain, start, length)]`` for the contiguous segments of a stream."""
    out = []
    for row in stream:
        if out and int(row["segment"]) == out[-1][3]:
            domain, start, length, seg = out[-1]
            out[-1] = (domain, start, length + 1, seg)
        else:
            out.append((row["domain"], int(row["position"]), 1, int(row["segment"])))
    return [(d, s, n) for d, s, n, _ in out]


def recurrence(stream, key="source_id"):
    """How often the clean utterances recur in a stream: ``(distinct, mean, max)`` appearances per
    ``key`` value (the clean utterance a noisy one was mixed from; ``ID`` for rows without it)."""
    counts = {}
    for row in stream:
        ident = row.get(key) or row["ID"]
        counts[ident] = counts.get(ident, 0) + 1
    if not counts:
        return 0, 0.0, 0
    return len(counts), len(stream) / len(counts), max(counts.values())


def boundaries(stream):
    """Positions where ``segment`` changes (the first position of every segment but the first)."""
    return [start for _, start, _ in runs(stream)[1:]]
