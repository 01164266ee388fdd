"""The LS-C and CHiME-3 run.sh scripts on tiny fake corpora (stages 0-2, dry-run 3-4)."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fake_corpora import estimate_snr_db, make_chime3, make_librispeech, make_ms_snsd
from tta_brain import hparams
from tta_brain.data.audio import load_audio
from tta_brain.data.manifest import STREAM_COLUMNS, read_manifest, validate_manifest
from tta_brain.data.mixing import gaussian_noise, tile_or_cut, utterance_seed
from tta_brain.data.prep.noise_table import LS_C_NOISES
from tta_brain.data.streams import LS_C_DOMAINS, MD_EASY_ORDER, MD_HARD_ORDER, runs

REPO = Path(__file__).resolve().parents[1]
LSC = REPO / "recipes" / "librispeech_c" / "run.sh"
CHIME = REPO / "recipes" / "chime3" / "run.sh"
PER_DOMAIN = 25   # scaled-down MD-Easy/Hard (s=100 -> 5 cycles of 5, s=20 -> 25 cycles of 1)
MD_LONG = dict(total=240, min_len=3, max_len=30)


def run(script, *args, env=None):
    base = {k: v for k, v in os.environ.items() if k not in ("LIBRISPEECH", "MS_SNSD", "CHIME3")}
    base.update(env or {})
    return subprocess.run(["bash", str(script), *map(str, args)], env=base, cwd=REPO,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def lsc(tmp_path_factory):
    root = tmp_path_factory.mktemp("lsc")
    make_librispeech(root / "corpus", speakers=(11, 12, 13, 14, 15), chapters=(100,), utts=5)
    make_ms_snsd(root / "MS-SNSD")
    env = {"LIBRISPEECH": str(root / "corpus"), "MS_SNSD": str(root / "MS-SNSD")}
    data = root / "data"
    res = run(LSC, "--stop_stage", 2, "--data_dir", data, "--per_domain", PER_DOMAIN,
              "--md_long_total", MD_LONG["total"], "--md_long_min", MD_LONG["min_len"],
              "--md_long_max", MD_LONG["max_len"], env=env)
    assert res.returncode == 0, res.stderr
    return root, data, env, res


def test_lsc_stage0_manifest(lsc):
    _, data, _, res = lsc
    rows = validate_manifest(data / "librispeech_test_other.csv")
    assert len(rows) == 25
    assert "Stage 0" in res.stderr and "Stage 2" in res.stderr


def test_lsc_stage1_corrupted_sets_and_measured_snr(lsc):
    root, data, _, _ = lsc
    clean = {r["ID"]: r for r in read_manifest(data / "librispeech_test_other.csv")}
    for code in LS_C_DOMAINS:
        rows = validate_manifest(data / "ls_c" / "manifests" / f"{code}_5dB.csv")
        assert len(rows) == 25 and {r["domain"] for r in rows} == {code}
        for r in rows[:2]:
            wav = read_manifest(data / "ls_c" / "manifests" / f"{code}_5dB.csv",
                                replacements={"data_root": data})[rows.index(r)]["wav"]
            assert wav == str(data / "ls_c" / "5dB" / code / f"{r['source_id']}.wav")
            speech = load_audio(clean[r["source_id"]]["wav"]).numpy()
            if code == "GS":
                noise = gaussian_noise(speech.size, utterance_seed(666, r["source_id"]))
            else:
                noise = tile_or_cut(load_audio(root / "MS-SNSD" / "noise_test" /
                                               LS_C_NOISES[code]).numpy(), speech.size)
            assert estimate_snr_db(load_audio(wav).numpy(), speech, noise) == \
                pytest.approx(5.0, abs=0.1)


def test_lsc_stage2_streams(lsc):
    _, data, _, _ = lsc
    sdir = data / "snr5" / "streams"
    names = {p.stem for p in sdir.glob("*.csv")}
    assert names == set(LS_C_DOMAINS) | {"md_easy", "md_hard", "md_easy_s100", "md_easy_s20",
                                         "md_hard_s100", "md_hard_s20", "md_long"}
    for name in names:
        validate_manifest(sdir / f"{name}.csv", required=STREAM_COLUMNS)
    single = read_manifest(sdir / "AC.csv")
    assert len(single) == 25 and {r["segment"] for r in single} == {"0"}
    for name, order in (("md_easy", MD_EASY_ORDER), ("md_hard", MD_HARD_ORDER)):
        for suffix, block in (("", PER_DOMAIN), ("_s100", 5), ("_s20", 1)):
            stream = read_manifest(sdir / f"{name}{suffix}.csv")
            blocks = runs(stream)
            assert len(stream) == 5 * PER_DOMAIN
            assert [b[0] for b in blocks] == list(order) * (PER_DOMAIN // block)
            assert all(b[2] == block for b in blocks)
            assert {r["snr"] for r in stream} == {"5"}
    long_blocks = runs(read_manifest(sdir / "md_long.csv"))
    assert sum(b[2] for b in long_blocks) == MD_LONG["total"]
    assert all(MD_LONG["min_len"] <= b[2] <= MD_LONG["max_len"] for b in long_blocks[:-1])
    assert all(a[0] != b[0] for a, b in zip(long_blocks, long_blocks[1:]))


def test_lsc_stage2_rerun_keeps_streams(lsc):
    _, data, env, _ = lsc
    before = (data / "snr5" / "streams" / "md_long.csv").read_bytes()
    res = run(LSC, "--stage", 2, "--stop_stage", 2, "--data_dir", data, "--per_domain", PER_DOMAIN,
              "--md_long_total", MD_LONG["total"], "--md_long_min", MD_LONG["min_len"],
              "--md_long_max", MD_LONG["max_len"], env=env)
    assert res.returncode == 0, res.stderr
    assert "skipping" in res.stderr
    assert (data / "snr5" / "streams" / "md_long.csv").read_bytes() == before


def test_lsc_stage3_4_dry_run_commands(lsc, tmp_path):
    _, data, env, _ = lsc
    hp, conf = tmp_path / "hparams", tmp_path / "conf"
    hp.mkdir()
    conf.mkdir()
    from tta_brain import hparams      # own yamls: the dry run checks each run's settings
    for name in ("suta", "dsuta"):
        (hp / f"{name}.yaml").write_text(hparams.compose(hparams.find(name)))
    (conf / "dsuta+dynamic.opts").write_text("# dynamic reset\n--reset=dynamic\n")
    exp = tmp_path / "exp"
    res = run(LSC, "--stage", 3, "--data_dir", data, "--exp_dir", exp, "--hparams_dir", hp,
              "--conf_dir", conf, "--methods", "suta dsuta+dynamic", "--streams", "AC md_easy",
              "--seeds", "0 1", "--model", "/models/w2v2", "--md_decode_opts", "--steps=5",
              "--dry_run", "true", env=env)
    assert res.returncode == 0, res.stderr
    cmds = [shlex.split(line[len("DRY-RUN:"):]) for line in res.stdout.splitlines()
            if line.startswith("DRY-RUN:")]
    decodes = [c for c in cmds if "tta_brain.decode" in c]
    assert len(decodes) == 2 * 2 * 2   # (a finished run is skipped by the grid at run time)
    first = decodes[0]
    assert first[first.index("-m") + 1:first.index("-m") + 3] == ["tta_brain.decode",
                                                                  str(hp / "suta.yaml")]
    assert f"--stream_csv={data}/snr5/streams/AC.csv" in first
    assert f"--output_folder={exp}/snr5/AC/suta/seed0" in first
    assert "--source=/models/w2v2" in first and "--seed=0" in first
    assert f"--data_root={data}" in first and "--steps=5" not in first
    assert all("--steps=5" in c for c in decodes if any("md_easy.csv" in a for a in c))
    variant = [c for c in decodes if any("/dsuta+dynamic/" in a for a in c)]
    assert len(variant) == 4  # AC and md_easy x 2 seeds
    assert all(str(hp / "dsuta.yaml") in c and "--reset=dynamic" in c for c in variant)
    assert not any("--reset=dynamic" in c for c in decodes if c not in variant)
    reports = [c for c in cmds if "tta_brain.report" in c]
    assert reports == [[*reports[0][:3], "--exp_dir", f"{exp}/snr5", "--out",
                        f"{exp}/snr5/RESULTS.md"]]
    res = run(LSC, "--stage", 3, "--hparams_dir", hp, "--methods", "nomethod", "--data_dir", data,
              "--streams", "AC", "--dry_run", "true", env=env)
    assert res.returncode == 1 and "method 'nomethod'" in res.stderr
    assert "no packaged method 'nomethod'" in res.stderr and "dsuta" in res.stderr


@pytest.mark.parametrize("script,var", [(LSC, "LIBRISPEECH"), (CHIME, "CHIME3")])
def test_without_data_stops_at_stage0_with_what_to_set(script, var, tmp_path):
    res = run(script, "--data_dir", tmp_path / "d", "--exp_dir", tmp_path / "e")
    assert res.returncode == 1
    assert f"ERROR: {var} is not set" in res.stderr and "db.sh" in res.stderr
    assert "Stage 0" in res.stderr and "Stage 1" not in res.stderr
    # the run stops right at the message: it is stderr's last line, and stage 0's step never ran
    last = res.stderr.splitlines()[-1].strip()
    assert last.startswith("Set it in ") and last.endswith(f"db.sh or export {var}=... before "
                                                           "running.")
    assert not (tmp_path / "e").exists() and not (tmp_path / "d").exists()


@pytest.mark.parametrize("script", [LSC, CHIME])
def test_help_and_invalid_options(script):
    res = run(script, "--help")
    assert res.returncode == 0
    assert "Usage:" in res.stdout and "--stage" in res.stdout and "--methods" in res.stdout
    res = run(script, "--no_such_option", 1)
    assert res.returncode == 1 and "invalid option --no-such-option" in res.stderr
    res = run(script, "--dry-run", "maybe")
    assert res.returncode == 1 and "expects true or false" in res.stderr
    res = run(script, "--stage", "three")
    assert res.returncode == 1 and "option --stage expects an integer, got 'three'" in res.stderr
    assert "Stage" not in res.stderr                      # nothing ran
    res = run(script, "--stop-stage=2x")
    assert res.returncode == 1 and "option --stop-stage expects an integer, got '2x'" in res.stderr
    res = run(script, "--stage", 3, "--stop_stage", 1)
    assert res.returncode == 1 and "--stage 3 is after --stop-stage 1: no stage would run" in \
        res.stderr and "Finished" not in res.stdout + res.stderr
    res = run(script, "extra")                            # a stray word: not ignored
    assert res.returncode == 1 and res.stderr == f"{script}: unexpected argument(s): extra\n"


def test_lsc_missing_noise_folder_stops_at_stage1(lsc, tmp_path):
    root, _, _, _ = lsc
    res = run(LSC, "--stop_stage", 1, "--data_dir", tmp_path / "d",
              env={"LIBRISPEECH": str(root / "corpus")})
    assert res.returncode == 1 and "ERROR: MS_SNSD is not set" in res.stderr
    assert (tmp_path / "d" / "librispeech_test_other.csv").is_file()


def test_chime3_stages_0_to_2_and_decode_dry_run(tmp_path):
    refs = make_chime3(tmp_path / "CHiME3", per_split=3)
    env = {"CHIME3": str(tmp_path / "CHiME3")}
    data, exp = tmp_path / "data", tmp_path / "exp"
    res = run(CHIME, "--stop_stage", 2, "--data_dir", data, env=env)
    assert res.returncode == 0, res.stderr
    assert "utterances per split: bus_real=3" in res.stdout
    stream = validate_manifest(data / "streams" / "chime3.csv", required=STREAM_COLUMNS)
    assert len(stream) == 21 and "ped_real" not in {r["domain"] for r in stream}
    assert sorted(r["ID"] for r in stream) == sorted(i for i in refs if "PED_REAL" not in i)
    assert [r["ID"] for r in stream] != sorted(r["ID"] for r in stream)  # random order
    for r in stream:
        assert r["wrd"] == refs[r["ID"]]
    # stage 3 as the issue asks: `run.sh --stage 3` decodes (dry run here) and reports
    hp = tmp_path / "hp"
    hp.mkdir()
    from tta_brain import hparams      # an own yaml: the dry run checks each run's settings
    (hp / "dsuta.yaml").write_text(hparams.compose(hparams.find("dsuta")))
    res = run(CHIME, "--stage", 3, "--data_dir", data, "--exp_dir", exp, "--hparams_dir", hp,
              "--methods", "dsuta", "--seeds", "0 1 2", "--dry_run", "true", env=env)
    assert res.returncode == 0, res.stderr
    lines = [shlex.split(x[len("DRY-RUN:"):]) for x in res.stdout.splitlines()
             if x.startswith("DRY-RUN:")]
    decodes = [c for c in lines if "tta_brain.decode" in c]
    assert len(decodes) == 3
    assert f"--data_root={tmp_path / 'CHiME3'}" in decodes[0]
    assert f"--output_folder={exp}/chime3/dsuta/seed2" in decodes[2]
    assert "--source=facebook/wav2vec2-base-960h" in decodes[0]
    assert any("tta_brain.report" in c for c in lines)
    # all 8 splits on request
    res = run(CHIME, "--stop_stage", 0, "--data_dir", tmp_path / "d8", "--include_ped_real",
              "true", env=env)
    assert res.returncode == 0, res.stderr
    assert len(read_manifest(tmp_path / "d8" / "chime3_et05.csv")) == 24


def test_parse_options_standalone(tmp_path):
    script = tmp_path / "s.sh"
    script.write_text(f"""set -euo pipefail
foo_bar=1
flag=false
count=
internal=/somewhere
stop_stage=3
stage=0
int_options="count"
append_options="foo_bar"
help_message="usage: s.sh --foo-bar X --flag true|false --count N --stage N --stop_stage N"
. {REPO}/tools/parse_options.sh
echo "foo_bar=$foo_bar flag=$flag count=$count stage=$stage rest=$*"
echo "given=[$po_given]" >&2
""")

    def sh(*args):
        return subprocess.run(["bash", str(script), *map(str, args)], capture_output=True,
                              text=True)
    out = sh("--foo-bar", "x y", "--flag=true", "pos1", "--z")
    assert out.returncode == 0 and out.stdout.strip() == \
        "foo_bar=x y flag=true count= stage=0 rest=pos1 --z"
    assert out.stderr == "given=[ foo_bar flag ]\n"   # what was given, not what has a value
    out = sh("--help")
    assert out.returncode == 0 and out.stdout.startswith("usage: s.sh --foo-bar X")
    assert "--config FILE" in out.stdout
    out = sh("--foo-bar")
    assert out.returncode == 1 and "needs a value" in out.stderr
    # a defined variable that the help does not list is no option
    out = sh("--internal", "/x")
    assert out.returncode == 1 and "invalid option --internal (see --help)" in out.stderr
    assert out.stdout == ""
    # an integer option with an empty default: empty or an integer; --stage never empty
    assert sh("--count", "").returncode == 0
    out = sh("--stage", "")
    assert out.returncode == 1 and "option --stage expects an integer, got ''" in out.stderr
    # "--" ends the options and is no argument of the script's own
    out = sh("--flag", "true", "--", "--foo-bar", "x")
    assert out.returncode == 0 and out.stdout.strip() == \
        "foo_bar=1 flag=true count= stage=0 rest=--foo-bar x"
    out = sh("--count", "abc")
    assert out.returncode == 1 and "option --count expects an integer, got 'abc'" in out.stderr
    # a stage after the script's last one (the default --stop_stage) would run nothing
    out = sh("--stage", 7, "--stop_stage", 9)
    assert out.returncode == 1 and "--stage 7: this script's last stage is 3" in out.stderr
    assert sh("--stage", 3, "--stop_stage", 9).returncode == 0
    # --config: NAME=VALUE lines checked as the options are, in their place
    cfg = tmp_path / "c.conf"
    cfg.write_text("# a comment\r\n\nfoo_bar=\"from config\"  # why\r\nflag='true'\ncount=4")
    out = sh("--foo-bar", "first", "--config", cfg, "pos")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "foo_bar=from config flag=true count=4 stage=0 rest=pos"
    assert out.stderr == "given=[ foo_bar flag count ]\n"     # --config's lines are given too
    assert sh("--config", cfg, "--foo-bar", "last").stdout.startswith("foo_bar=last ")
    # a list option given twice on the command line: both (it kept the last one, silently)
    assert sh("--foo-bar", "a", "--foo_bar=b c").stdout.startswith("foo_bar=a b c ")
    assert sh("--config", cfg, "--config", cfg).stdout.strip() == \
        "foo_bar=from config flag=true count=4 stage=0 rest="      # one list, not two
    assert sh("--flag", "true", "--flag", "false").stdout.split()[1] == "flag=false"
    for text, message in [("flag=maybe\n", "c.conf:1: option --flag expects true or false"),
                          ("\ninternal=/x\n", "c.conf:2: invalid option --internal"),
                          ("foo_bar=a b\n", "c.conf:1: foo_bar: quote a value with spaces"),
                          ("echo hi\n", "c.conf:1: expected NAME=VALUE"),
                          ("count=$(touch pwned)\n", "c.conf:1: count: quote a value")]:
        cfg.write_text(text)
        out = sh("--config", cfg)
        assert out.returncode == 1 and message in out.stderr, (text, out.stderr)
        assert out.stdout == "" and not (tmp_path / "pwned").exists()
    cfg.write_text("\ncount=abc\n")            # an integer option's value names its line too
    assert "c.conf:2: option --count expects an integer, got 'abc'" in sh("--config", cfg).stderr
    assert sh("--config", cfg, "--count", "3").returncode == 0     # the command line's comes last
    cfg.write_text("count=3\n")
    out = sh("--config", cfg, "--count", "x")
    assert out.returncode == 1 and "c.conf" not in out.stderr and "got 'x'" in out.stderr
    assert "config file nothere.conf not found" in sh("--config", "nothere.conf").stderr
    # ~ in --name=~/x and in a --config line is the home folder (a folder named ~ was made)
    home = os.path.expanduser("~")
    assert sh("--foo-bar=~/x y").stdout.startswith(f"foo_bar={home}/x y ")
    assert sh("--foo-bar=~").stdout.startswith(f"foo_bar={home} ")
    assert sh("--foo-bar=a~/b").stdout.startswith("foo_bar=a~/b ")
    # --name=VALUE splits at the first "=": a value with its own (--decode_opts=--lr=1e-4) is whole
    assert sh("--foo-bar=--lr=1e-4").stdout.startswith("foo_bar=--lr=1e-4 ")
    cfg.write_text("foo_bar=~/from/config\n")
    assert sh("--config", cfg).stdout.startswith(f"foo_bar={home}/from/config ")
    # a "--" after a path's "/" or "." is no option either (a clone in /srv/--old, in the help)
    script.write_text(script.read_text().replace("--stop_stage N",
                                                 "--stop_stage N (/srv/--old/a.--b)"))
    out = sh("--help")
    assert out.returncode == 0 and "/srv/--old/a.--b" in out.stdout, out.stderr
    # a help that lists an option the script does not have is a script error
    script.write_text(script.read_text().replace("--stop_stage N", "--stop_stage N --ghost X"))
    out = sh("--help")
    assert out.returncode == 1 and "the help lists --ghost, which is no option" in out.stderr


@pytest.mark.parametrize("script", [LSC, CHIME, REPO / "recipes" / "synthetic" / "run.sh"])
def test_recipe_options_are_what_the_help_lists(script, tmp_path):
    """Every --name of a recipe's --help is an option (--help exits 0 only then), its own
    variables are not, --config is read as options, and a stage after the last is refused."""
    res = run(script, "--help")
    assert res.returncode == 0, res.stderr
    assert "--config FILE" in res.stdout
    # every option with its default: a true|false one says which
    flags = re.findall(r"--(\w+) true\|false(?: \((true|false)\b)?", res.stdout)
    assert "dry_run" in dict(flags) and [n for n, default in flags if not default] == []
    for internal in ("repo_root", "recipe_dir", "help_message", "int_options", "grid_help"):
        res = run(script, f"--{internal}", "/x")
        assert res.returncode == 1 and f"invalid option --{internal.replace('_', '-')}" in \
            res.stderr, internal
    last = {"chime3": 4, "librispeech_c": 4, "synthetic": 5}[script.parent.name]
    res = run(script, "--stage", last + 1, "--stop_stage", last + 3)
    assert res.returncode == 1 and f"this script's last stage is {last}" in res.stderr
    assert "Stage" not in res.stderr
    cfg = tmp_path / "opts.conf"
    cfg.write_text('methods="suta dsuta"\nnj=nine\n')
    res = run(script, "--config", cfg)
    assert res.returncode == 1 and "option --nj expects an integer, got 'nine'" in res.stderr
    assert "Stage" not in res.stderr
    cfg.write_text("repo_root=/x\n")
    res = run(script, "--config", cfg)
    assert res.returncode == 1 and f"{cfg}:1: invalid option --repo-root" in res.stderr
    md = run(script, "--md_decode_opts", "--steps=2", "--stage", last + 1, "--stop_stage", last + 1)
    if script == CHIME:    # one stream, no multi-domain option set: not in its help, no option
        assert "--md_decode_opts" not in run(script, "--help").stdout
        assert md.returncode == 1 and "invalid option --md-decode-opts" in md.stderr
    else:
        assert "invalid option" not in md.stderr and "last stage" in md.stderr


def test_recipe_streams_and_sweep_given_twice_add_up(tmp_path):
    """README: --streams and --sweep given twice on a recipe's command line add up, as the
    grid's do (dry runs: the streams stage's names, the decode stage's runs)."""
    where = ("--data_dir", tmp_path / "d", "--exp_dir", tmp_path / "e", "--dry_run", "true")
    res = run(LSC, "--stage", 2, "--stop_stage", 2, "--streams", "AC", "--streams", "SD md_easy",
              *where)
    assert res.returncode == 0, res.stderr
    prep = [shlex.split(x[len("DRY-RUN:"):]) for x in res.stdout.splitlines()
            if x.startswith("DRY-RUN:") and "prepare streams" in x]
    assert len(prep) == 1
    after = prep[0][prep[0].index("--names") + 1:]
    assert after[:after.index("--seed")] == ["AC", "SD", "md_easy"]
    res = run(LSC, "--stage", 3, "--stop_stage", 3, "--methods", "suta", "--seeds", 0,
              "--streams", "AC", "--sweep", "lr=1e-4,3e-4", "--sweep", "steps=1,2", *where)
    assert res.returncode == 0, res.stderr
    decodes = [shlex.split(x[len("DRY-RUN:"):]) for x in res.stdout.splitlines()
               if x.startswith("DRY-RUN:") and "tta_brain.decode" in x]
    runs = {tuple(a for a in c if a.startswith(("--lr=", "--steps="))) for c in decodes}
    assert len(decodes) == 4 and runs == {(f"--lr={lr}", f"--steps={n}")
                                          for lr in ("1e-4", "3e-4") for n in (1, 2)}


def test_a_stream_of_your_own_name_gets_the_multi_domain_options(lsc, tmp_path):
    _, data, env, _ = lsc
    res = run(LSC, "--stage", 2, "--stop_stage", 2, "--data_dir", data, "--streams",
              "held_out=md_easy", "--per_domain", PER_DOMAIN, env=env)
    assert res.returncode == 0, res.stderr
    res = run(LSC, "--stage", 3, "--stop_stage", 3, "--data_dir", data, "--exp_dir", tmp_path,
              "--streams", "AC held_out=md_easy", "--methods", "dsuta", "--seeds", "0",
              "--model", "/models/w2v2", "--md_decode_opts", "--steps=5", "--dry_run", "true",
              env=env)
    assert res.returncode == 0, res.stderr
    assert "snr5/held_out: multi-domain option set" in res.stderr      # the log says which set
    assert "snr5/AC: single-domain option set" in res.stderr
    cmds = [shlex.split(x[len("DRY-RUN:"):]) for x in res.stdout.splitlines()
            if x.startswith("DRY-RUN:")]
    held = [c for c in cmds if f"--stream_csv={data}/snr5/streams/held_out.csv" in c]
    assert len(held) == 1 and "--steps=5" in held[0] and "--stream_name=held_out" in held[0]
    assert f"--output_folder={tmp_path}/snr5/held_out/dsuta/seed0" in held[0]
    assert all("--steps=5" not in c for c in cmds if c not in held)


def test_synthetic_reset_periods_follow_the_block_size(tmp_path):
    """K = per_domain / 2 and the fixed period per_domain / 4 on the multi-domain streams, passed
    only to the methods that have those keys and whose reset reads them (K: dynamic, the period:
    fixed; they reached every run, read by none of the others)."""
    streams = tmp_path / "data" / "snr20" / "streams"
    streams.mkdir(parents=True)
    for name in ("md_hard", "GS"):
        (streams / f"{name}.csv").write_text("ID,duration,wav,wrd\n")
    res = run(REPO / "recipes" / "synthetic" / "run.sh", "--stage", 4, "--stop_stage", 4,
              "--data_dir", tmp_path / "data", "--exp_dir", tmp_path / "exp", "--streams",
              "md_hard GS", "--methods", "suta dsuta+dynamic", "--per_domain", 60,
              "--dry_run", "true")
    assert res.returncode == 0, res.stderr
    cmds = [shlex.split(x[len("DRY-RUN:"):]) for x in res.stdout.splitlines()
            if x.startswith("DRY-RUN:")]
    dyn_md = [c for c in cmds if "--stream_name=md_hard" in c and "--reset=dynamic" in c]
    assert len(dyn_md) == 1 and "--reset_K=30" in dyn_md[0]
    assert not [a for a in dyn_md[0] if a.startswith("--reset_every")]
    assert not any("--reset_K=30" in c for c in cmds if "--stream_name=GS" in c)
    assert not any("--reset_K=30" in c for c in cmds if c[c.index("tta_brain.decode") + 1] == "suta")
    for opt in ("--reset_K=30", "--reset_every=15"):     # logged once, not once per stream
        assert res.stderr.count(f"suta: --md_recipe_opts {opt} is not a key of its yaml") == 1
    # small blocks: the smallest K and period that DSUTA's own yaml accepts (were 2 and 0, then
    # K 4 < 2 x buffer_size: every +fixed / +dynamic run failed on a key the user never set);
    # --md_recipe_opts given: it, not the rule (was ignored)
    for extra, wants in ((["--per_domain", 3], (["--reset_every=1"], ["--reset_K=10"])),
                         (["--per_domain", 6], (["--reset_every=1"], ["--reset_K=10"])),
                         (["--md_recipe_opts", "--reset_K=12"], ([], ["--reset_K=12"]))):
        for method, want in zip(("dsuta+fixed", "dsuta+dynamic"), wants):
            res = run(REPO / "recipes" / "synthetic" / "run.sh", "--stage", 4, "--stop_stage", 4,
                      "--data_dir", tmp_path / "data", "--exp_dir", tmp_path / "exp", "--streams",
                      "md_hard", "--methods", method, *extra, "--dry_run", "true")
            assert res.returncode == 0, res.stderr
            cmd = [shlex.split(x[len("DRY-RUN:"):]) for x in res.stdout.splitlines()
                   if "tta_brain.decode" in x][0]
            given = [a for a in cmd if a.startswith(("--reset_K", "--reset_every"))]
            assert given == want
            if "--md_recipe_opts" not in extra:      # the recipe's own values pass the yaml's rules
                hparams.resolve("dsuta", {"source": "x", "stream_csv": "x", "output_folder": "x",
                                          "reset": method.partition("+")[2], **{
                    a[2:].split("=")[0]: int(a.split("=")[1]) for a in given}})
    # the recipe's own settings are no typo: a grid of methods without resets runs too
    res = run(REPO / "recipes" / "synthetic" / "run.sh", "--stage", 4, "--stop_stage", 4,
              "--data_dir", tmp_path / "data", "--exp_dir", tmp_path / "exp", "--streams",
              "md_hard", "--methods", "tent sdpl", "--dry_run", "true")
    assert res.returncode == 0, res.stderr
    assert not any("--reset_K" in x for x in res.stdout.splitlines() if x.startswith("DRY-RUN:"))


def test_synthetic_streams_stage_passes_only_the_sizes_its_streams_take(tmp_path):
    """The quick start's stage 3 warned "--total --min_len --max_len: no stream of md_easy
    md_hard takes it": the recipe passed its md_long defaults to every stream set. A size the
    user gives in vain is still said."""
    manifests = tmp_path / "data" / "noisy" / "manifests"
    manifests.mkdir(parents=True)
    for d in ("GS", "BA", "AC", "TP", "VC", "SD", "MU", "TR"):
        rows = "".join(f"u{i}_{d},1.5,$data_root/noisy/20dB/{d}/u{i}.wav,1,WORD {i},{d},20,u{i}\n"
                       for i in range(12))
        (manifests / f"{d}_20dB.csv").write_text(
            "ID,duration,wav,spk_id,wrd,domain,snr,source_id\n" + rows)
    syn = REPO / "recipes" / "synthetic" / "run.sh"
    base = ["--stage", 3, "--stop_stage", 3, "--data_dir", tmp_path / "data", "--per_domain", 4]
    res = run(syn, *base)
    assert res.returncode == 0, res.stderr
    assert "takes it" not in res.stderr and "wrote stream md_hard: 20 utterances" in res.stderr
    res = run(syn, *base, "--streams", "md_long", "--md_long_total", 30, "--md_long_min", 3,
              "--md_long_max", 10)
    assert res.returncode == 0, res.stderr
    assert "wrote stream md_long: 30 utterances" in res.stderr
    assert "of 8 domain(s) (AC BA GS MU SD TP TR VC)" in res.stderr   # the ones it draws from
    assert "--per_domain: no stream of md_long takes it" in res.stderr    # given, and unused
    res = run(syn, *base, "--md_long_max", 10)
    assert res.returncode == 0, res.stderr
    assert "--max_len: no stream of md_easy md_hard takes it" in res.stderr


@pytest.mark.parametrize("recipe", ["synthetic", "librispeech_c", "chime3"])
def test_dry_run_writes_nothing_and_prints_every_stage(recipe, tmp_path):
    """--dry_run prints the stages' commands and the runs; no file or folder is made."""
    env = {"LIBRISPEECH": str(tmp_path / "LS"), "MS_SNSD": str(tmp_path / "MS"),
           "CHIME3": str(tmp_path / "C3"), "W2V2": str(tmp_path / "w2v2")}
    res = run(REPO / "recipes" / recipe / "run.sh", "--data_dir", tmp_path / "data", "--exp_dir",
              tmp_path / "exp", "--dry_run", "true", env=env)
    assert res.returncode == 0, res.stderr
    lines = [x for x in res.stdout.splitlines() if x.startswith("DRY-RUN:")]
    assert any("tta_brain.data.prep" in x for x in lines)
    assert any("-m tta_brain.decode" in x for x in lines)
    assert any("-m tta_brain.report" in x for x in lines)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("recipe,last", [("synthetic", 5), ("librispeech_c", 4), ("chime3", 4)])
def test_stage_n_to_stop_stage_n_runs_that_stage_alone(recipe, last, tmp_path):
    """--stage N --stop_stage N (dry run) runs stage N and no other: neither the stage before
    (a rerun of finished work, needing its corpus) nor the one after."""
    for n in range(last + 1):
        res = run(REPO / "recipes" / recipe / "run.sh", "--data_dir", tmp_path / "data",
                  "--exp_dir", tmp_path / "exp", "--dry_run", "true", "--stage", n,
                  "--stop_stage", n)
        assert res.returncode == 0, res.stderr
        assert set(re.findall(r"\) Stage (\d+)", res.stderr)) == {str(n)}, (n, res.stderr)
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("recipe,args,expected", [
    ("librispeech_c", ["--noise_seed", 7, "--stream_seed", 3, "--per_domain", 25],
     {"corrupt": ["--seed 7"], "streams": ["--seed 3", "--max_duration 20", "--per_domain 25"]}),
    ("chime3", ["--include_ped_real", "true", "--keep_raw_text", "true", "--max_duration", 15,
                "--stream_seed", 3],
     {"chime3": ["--include_ped_real", "--keep_raw_text"],
      "streams": ["--seed 3", "--max_duration 15"]}),
    ("synthetic", ["--retrain", "true", "--n_train", 50, "--corpus_seed", 5, "--noise_seed", 6,
                   "--stream_seed", 3, "--streams", "md_easy_s20 md_hard_s100"],
     {"corpus": ["--n_train 50", "--seed 5"], "noises": ["--seed 6"], "corrupt": ["--seed 6"],
      "streams": ["--seed 3", "--per_domain 80"]}),
])
def test_dry_run_data_commands_carry_the_recipe_options(recipe, args, expected, tmp_path):
    """The data stages' options reach their commands (a seed, a duration limit, a size or a
    switch dropped on the way made another corpus or stream without a word)."""
    res = run(REPO / "recipes" / recipe / "run.sh", "--data_dir", tmp_path / "data", "--model",
              tmp_path / "model", "--dry_run", "true", "--stop_stage",
              3 if recipe == "synthetic" else 2, *args)
    assert res.returncode == 0, res.stderr
    steps = {}      # prep step -> " its options "
    for line in res.stdout.splitlines():
        if line.startswith("DRY-RUN:") and "tta_brain.data.prep" in line:
            argv = shlex.split(line[len("DRY-RUN:"):])
            steps[argv[3]] = f" {' '.join(argv[4:])} "
    for step, opts in expected.items():
        for opt in opts:
            assert f" {opt} " in steps[step], (step, opt, steps[step])
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("recipe", ["synthetic", "librispeech_c", "chime3"])
def test_a_recipe_runs_from_a_linked_folder_with_cdpath_and_a_python_path_with_a_space(
        recipe, tmp_path):
    """run.sh through a link to its folder (``..`` of the logical path was not the repo: "No
    such file" for tools/log.sh), with CDPATH exported (``cd`` printed the folder into
    recipe_dir), in a clone whose path holds "--" (the help's path was read as an option and
    --help exited 1) and with a --python whose path has a space (word-split)."""
    env = {"LIBRISPEECH": str(tmp_path / "LS"), "MS_SNSD": str(tmp_path / "MS"),
           "CHIME3": str(tmp_path / "C3"), "W2V2": str(tmp_path / "w2v2"),
           "CDPATH": f".:{tmp_path}"}
    (tmp_path / "my recipe").symlink_to(REPO / "recipes" / recipe)
    (tmp_path / "tta--old").symlink_to(REPO)
    py = tmp_path / "py dir" / "python3"
    py.parent.mkdir()
    py.symlink_to(sys.executable)
    for script in (tmp_path / "my recipe" / "run.sh", Path("recipes") / recipe / "run.sh",
                   tmp_path / "tta--old" / "recipes" / recipe / "run.sh"):
        res = run(script, "--help", env=env)
        assert res.returncode == 0 and "Usage:" in res.stdout, res.stderr
        res = run(script, "--data_dir", tmp_path / "data", "--exp_dir", tmp_path / "exp",
                  "--python", py, "--dry_run", "true", env=env)
        assert res.returncode == 0, res.stderr
        assert any("-m tta_brain.decode" in x for x in res.stdout.splitlines()), res.stdout


@pytest.mark.parametrize("recipe,var", [("librispeech_c", "LIBRISPEECH"), ("chime3", "CHIME3")])
def test_a_dry_run_needs_no_corpus(recipe, var, tmp_path):
    """``--dry_run true`` stopped at stage 0 without the corpus path (db.sh), so the commands
    could not be seen before the download; now they name the unset variable as <VAR>."""
    res = run(REPO / "recipes" / recipe / "run.sh", "--data_dir", tmp_path / "data", "--exp_dir",
              tmp_path / "exp", "--dry_run", "true")
    assert res.returncode == 0, res.stderr
    assert f"dry run: {var} is not set; the commands say <{var}> (a real run stops here: " \
        in res.stderr
    first = next(x for x in res.stdout.splitlines() if x.startswith("DRY-RUN:"))
    assert f"<{var}>" in shlex.split(first[len("DRY-RUN:"):])
    assert any("-m tta_brain.decode" in x for x in res.stdout.splitlines())
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    real = run(REPO / "recipes" / recipe / "run.sh", "--data_dir", tmp_path / "data")
    assert real.returncode == 1 and f"ERROR: {var} is not set." in real.stderr


@pytest.mark.parametrize("opt,value", [("--per_domain", "abc"), ("--n_test", "8x"),
                                       ("--nj", "two"), ("--stats_utts", "1.5"),
                                       ("--nj", "")])     # empty: only where the default is
def test_count_options_take_integers_only(opt, value, tmp_path):
    """``--per_domain abc`` ended in bash's "abc: unbound variable" at the line that used it."""
    res = run(REPO / "recipes" / "synthetic" / "run.sh", "--data_dir", tmp_path / "d", opt, value)
    assert res.returncode == 1
    assert res.stderr.strip() == (f"{REPO / 'recipes' / 'synthetic' / 'run.sh'}: option "
                                  f"--{opt[2:].replace('_', '-')} expects an integer, got "
                                  f"'{value}'")
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("recipe", ["synthetic", "librispeech_c", "chime3"])
def test_bad_decode_settings_stop_the_recipe_before_its_data_stages(recipe, tmp_path):
    """``--methods "source bogus"`` or a sweep value no run takes were found at the decode stage,
    after the data stages (a failure per run); now the recipe checks them first and runs
    nothing."""
    env = {"LIBRISPEECH": str(tmp_path / "LS"), "MS_SNSD": str(tmp_path / "MS"),
           "CHIME3": str(tmp_path / "C3"), "W2V2": str(tmp_path / "w2v2")}
    script = REPO / "recipes" / recipe / "run.sh"
    base = ["--data_dir", tmp_path / "data", "--exp_dir", tmp_path / "exp"]
    for extra, said in ((["--methods", "source bogus"], "ERROR: --methods bogus: no packaged "
                                                        "method 'bogus'"),
                        (["--methods", "suta", "--sweep", "lr=1e-4,abc"],
                         "/suta_lrabc/seed0 will not run: ERROR: ")):
        res = run(script, *base, *extra, env=env)
        assert res.returncode == 1 and said in res.stdout + res.stderr, res.stderr
        decode_stage = 4 if recipe == "synthetic" else 3      # was a stream's name there
        assert f"stage {decode_stage} (decode) would refuse the runs above; nothing was run" \
            in res.stderr, res.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == []
    # the decode stage not asked for: no check (and no cost)
    res = run(script, *base, "--methods", "source bogus", "--stage", 99, "--stop_stage", 99,
              env=env)
    assert "would refuse" not in res.stderr
    if recipe != "synthetic":
        return
    # the grid's own options too (a --batch_runs of 0 was refused by the decode itself only)
    res = run(script, *base, "--methods", "suta", "--batch_runs", 0, "--stage", 4, env=env)
    assert res.returncode == 1 and "--batch_runs 0: must be an integer >= 1" in res.stderr
    assert "stage 4 (decode) would refuse" in res.stderr and not list(tmp_path.iterdir())
    # the runs the stage will decode, not stand-ins: a buffer of 30 fits the single-domain
    # stream's K (the yaml's 100), not md_easy's (the recipe's K 40 for blocks of 80)
    dyn = ["--methods", "dsuta+dynamic", "--decode_opts=--buffer_size=30", "--stage", 4]
    res = run(script, *base, *dyn, "--streams", "GS", env=env)
    assert "would refuse" not in res.stderr and "stream" in res.stderr    # (none written yet)
    res = run(script, *base, *dyn, "--streams", "md_easy", env=env)
    assert "md_easy/dsuta+dynamic_buffer_size30/seed0 will not run: ERROR: " in res.stdout
    assert "reset_K = 40 with buffer_size = 30" in res.stdout
    # and this machine's devices, as the decode stage will meet them
    if not torch_cuda():
        res = run(script, *base, "--methods", "source", "--decode_opts=--device=cuda", env=env)
        assert res.returncode == 1 and "no CUDA device here" in res.stdout
        assert "(decode) would refuse the runs above" in res.stderr


def torch_cuda():
    import torch
    return torch.cuda.is_available()


@pytest.mark.parametrize("recipe", ["librispeech_c", "chime3"])
def test_statistics_stage_uses_the_decodes_source_model(recipe, tmp_path):
    """Without --model the statistics are $W2V2's (db.sh: the hub's wav2vec2-base-960h unless
    set), the model the decode stage uses (the stage ran before the default was read:
    ``--source ''``)."""
    env = {"LIBRISPEECH": str(tmp_path / "LS"), "CHIME3": str(tmp_path / "C3"),
           "W2V2": str(tmp_path / "w2v2")}
    argv = [REPO / "recipes" / recipe / "run.sh", "--stage", 3, "--stop_stage", 3, "--methods",
            "eata", "--stats_csv", tmp_path / "clean.csv", "--data_dir", tmp_path / "data",
            "--exp_dir", tmp_path / "exp", "--dry_run", "true"]
    res = run(*argv, env=env)
    assert res.returncode == 0, res.stderr
    cmds = [shlex.split(x[len("DRY-RUN:"):]) for x in res.stdout.splitlines()
            if x.startswith("DRY-RUN:")]
    stats = [c for c in cmds if "tta_brain.stats" in c]
    assert stats and stats[0][stats[0].index("--source") + 1] == env["W2V2"]
    decodes = [c for c in cmds if "tta_brain.decode" in c]
    assert decodes and all(f"--source={env['W2V2']}" in c for c in decodes)
    assert "--target_lang" not in stats[0]
    env.pop("W2V2")
    res = run(*argv, env=env)
    assert res.returncode == 0 and "--source facebook/wav2vec2-base-960h" in res.stdout
    # an MMS checkpoint's language (the last one given, as decode takes it): its adapter's stats
    res = run(*argv, "--decode_opts", "--target_lang=deu --lr=1e-4 --target_lang=fra", env=env)
    assert res.returncode == 0, res.stderr
    stats = [shlex.split(x[len("DRY-RUN:"):]) for x in res.stdout.splitlines()
             if x.startswith("DRY-RUN:") and "tta_brain.stats" in x]
    assert stats and stats[0][stats[0].index("--target_lang") + 1] == "fra"


@pytest.mark.parametrize("recipe", ["librispeech_c", "chime3"])
def test_paper_recipes_decode_with_the_official_code_settings(recipe, tmp_path):
    """README: the LS-C and CHiME-3 recipes run SUTA, CSUTA, SDPL and DSUTA with the official
    optimiser list, CEA with the E-BATS reference's, SDPL in train mode and DSUTA's dynamic
    reset on the official code's LII values (their conf/*.opts)."""
    methods = ["suta", "csuta", "sdpl", "dsuta", "dsuta+dynamic", "cea", "tent"]
    res = run(REPO / "recipes" / recipe / "run.sh", "--stage", 3, "--stop_stage", 3, "--methods",
              " ".join(methods), "--seeds", 0, "--data_dir", tmp_path / "data", "--exp_dir",
              tmp_path / "exp", "--dry_run", "true", *(["--streams", "AC"] if recipe ==
                                                       "librispeech_c" else []))
    assert res.returncode == 0, res.stderr
    decodes = [shlex.split(x[len("DRY-RUN:"):]) for x in res.stdout.splitlines()
               if x.startswith("DRY-RUN:") and "tta_brain.decode" in x]
    folder = [Path(next(a for a in c if a.startswith("--output_folder="))) for c in decodes]
    got = {f.parent.name: {a for a in c if a.startswith(("--param_collection=", "--train_mode=",
                                                          "--reset_lii_count="))}
           for f, c in zip(folder, decodes)}
    official = {"--param_collection=official"}
    assert got == {"suta": official, "csuta": official, "dsuta": official,
                   "sdpl": official | {"--train_mode=true"},
                   "dsuta+dynamic": official | {"--reset_lii_count=official"},
                   "cea": {"--param_collection=ebats"}, "tent": set()}


def test_synthetic_statistics_speech_is_rendered_apart_from_the_streams(tmp_path):
    """README: without --stats_csv the synthetic recipe renders --stats_utts (100) clean
    utterances of its own (another seed: other sentences and speaker draws; no noise) and
    computes the statistics on them; --stats_csv names the manifest instead."""
    argv = [REPO / "recipes" / "synthetic" / "run.sh", "--stop_stage", 4, "--methods", "eata",
            "--data_dir", tmp_path / "d", "--exp_dir", tmp_path / "e", "--dry_run", "true"]

    def commands(*extra):
        res = run(*argv, *extra)
        assert res.returncode == 0, res.stderr
        return [shlex.split(x[len("DRY-RUN:"):]) for x in res.stdout.splitlines()
                if x.startswith("DRY-RUN:") and "tta_brain.decode" not in x]

    def opt(c, name):
        return c[c.index(name) + 1]
    cmds = commands()
    corpora = [c for c in cmds if "tta_brain.data.prep.synthetic" in c and "corpus" in c]
    assert len(corpora) == 2
    test, clean = corpora
    assert opt(clean, "--n_test") == "100" and opt(clean, "--n_train") == "0"
    assert opt(clean, "--seed") != opt(test, "--seed")
    assert opt(clean, "--root") != opt(test, "--root")
    manifest = next(opt(c, "--out") for c in cmds if "librispeech" in c
                    and opt(c, "--root") == opt(clean, "--root"))
    noisy = [c for c in cmds if "corrupt" in c]
    assert noisy and all(opt(c, "--manifest") != manifest for c in noisy)      # no noise added
    stats = [c for c in cmds if "tta_brain.stats" in c]
    assert len(stats) == 1 and opt(stats[0], "--manifest") == manifest
    assert opt(stats[0], "--max_utts") == "100"
    cmds = commands("--stats_csv", tmp_path / "clean.csv", "--stats_utts", 7)
    assert len([c for c in cmds if "tta_brain.data.prep.synthetic" in c and "corpus" in c]) == 1
    stats = [c for c in cmds if "tta_brain.stats" in c]
    assert opt(stats[0], "--manifest") == str(tmp_path / "clean.csv")
    assert opt(stats[0], "--max_utts") == "7"


def test_lsc_statistics_split_is_a_split_in_no_stream(tmp_path):
    """--stats_split names the LibriSpeech split of eata's statistics: dev-clean is prepared and
    read; the test split itself (test-other, the streams' speech) or a name that is no
    LibriSpeech split is refused in one line before any stage runs (it was refused at stage 3,
    after the data stages had run)."""
    argv = [LSC, "--stop_stage", 3, "--methods", "eata", "--seeds", 0,
            "--streams", "AC", "--data_dir", tmp_path / "data", "--exp_dir", tmp_path / "exp",
            "--dry_run", "true"]
    env = {"LIBRISPEECH": str(tmp_path / "LS")}
    accepted = "dev-clean dev-other test-clean train-clean-100 train-clean-360 train-other-500"
    for bad in ("test-other", "dev_clean"):
        res = run(*argv, "--stats_split", bad, env=env)
        assert res.returncode == 1 and res.stdout == ""
        assert res.stderr == (f"{LSC}: --stats_split {bad}: one of {accepted} "
                              "(a LibriSpeech split in no stream: --split test-other is the test "
                              "split; or --stats_csv CSV)\n")
    res = run(*argv, "--split", "test-clean", "--stats_split", "test-other", "--stage", 3, env=env)
    assert res.returncode == 0, res.stderr
    argv[1:1] = ["--stage", 3]
    res = run(*argv, "--stats_split", "dev-clean", env=env)
    assert res.returncode == 0, res.stderr
    cmds = [shlex.split(x[len("DRY-RUN:"):]) for x in res.stdout.splitlines()
            if x.startswith("DRY-RUN:")]
    prep = [c for c in cmds if "librispeech" in c and "--split" in c]
    stats = [c for c in cmds if "tta_brain.stats" in c]
    assert prep[0][prep[0].index("--split") + 1] == "dev-clean"
    assert stats[0][stats[0].index("--manifest") + 1] == prep[0][prep[0].index("--out") + 1]


def test_methods_all_decodes_every_packaged_method(tmp_path):
    """--methods all: every packaged method, and the statistics stage for those that need it."""
    from tta_brain import hparams
    res = run(REPO / "recipes" / "synthetic" / "run.sh", "--stage", 4, "--stop_stage", 4,
              "--data_dir", tmp_path / "data", "--exp_dir", tmp_path / "exp", "--methods", "all",
              "--dry_run", "true")
    assert res.returncode == 0, res.stderr
    cmds = [shlex.split(x[len("DRY-RUN:"):]) for x in res.stdout.splitlines()
            if x.startswith("DRY-RUN:")]
    decoded = {c[c.index("tta_brain.decode") + 1] for c in cmds if "tta_brain.decode" in c}
    assert decoded == set(hparams.available()) and len(decoded) >= 16
    stats = {Path(c[c.index("--out") + 1]).name: c[c.index("--kinds") + 1].split()
             for c in cmds if "tta_brain.stats" in c}
    assert stats == {"source_stats_eata.pt": ["fisher"], "source_stats_ebats.pt": ["hidden", "tokens"],
                     "source_stats_foa.pt": ["hidden"]}
    assert not (tmp_path / "data").exists()


def test_source_stats_one_file_per_method_never_rewritten(tmp_path, tiny_model_dir):
    """The recipes' stats stage (tools/recipe.sh) writes each method's statistics to its own
    file, which adding another method's statistics later leaves byte for byte as it was (its runs'
    fingerprints count that content); a current file is kept, a missing manifest is an error."""
    from fake_corpora import write_stream
    root = write_stream(tmp_path / "s", n=4, block=2)
    out = tmp_path / "stats"
    out.mkdir()

    def stage(methods, csv=root / "stream.csv"):
        script = (f'set -euo pipefail; recipe_dir={REPO}/recipes/synthetic; '
                  f'. {REPO}/tools/recipe.sh; methods={shlex.quote(methods)}; '
                  f'model={tiny_model_dir}; stats_utts=3; python={shlex.quote(sys.executable)}; '
                  f'source_stats_stage 4 "{csv}" "{root}" "{out}"')
        return subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True,
                              timeout=300)

    res = stage("source eata")
    assert res.returncode == 0, res.stderr
    eata = out / "source_stats_eata.pt"
    before = (eata.read_bytes(), eata.stat().st_mtime_ns)
    res = stage("foa ebats+dynamic eata")
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "source_stats_eata.pt", "source_stats_ebats.pt", "source_stats_foa.pt"]
    assert (eata.read_bytes(), eata.stat().st_mtime_ns) == before
    assert "source_stats_eata.pt: up to date" in res.stdout
    from tta_brain.methods import source_stats as ss
    assert ss.load(out / "source_stats_ebats.pt").kinds == ["hidden", "tokens"]
    assert ss.load(out / "source_stats_foa.pt").kinds == ["hidden"]
    assert ss.load(eata).kinds == ["fisher"]
    res = stage("suta sgem")                                     # nobody needs statistics
    assert res.returncode == 0 and "source statistics" not in res.stderr
    res = stage("foa", csv="")                                   # no manifest: keep the file
    assert res.returncode == 0 and "using" in res.stderr
    (out / "source_stats_foa.pt").unlink()
    res = stage("foa", csv="")
    assert res.returncode == 1 and "foa needs source statistics (hidden)" in res.stderr


@pytest.mark.parametrize("recipe", ["synthetic", "librispeech_c", "chime3"])
def test_grid_options_that_cannot_go_together_stop_before_any_stage(recipe, tmp_path):
    """--slurm_conf without --engine slurm (was ignored: the recipe decoded on this machine),
    --gpus with --engine slurm and an unknown engine stop the recipe at once, naming the option,
    before a data stage writes anything."""
    script = REPO / "recipes" / recipe / "run.sh"
    data = tmp_path / "data"
    for args, named in ((["--slurm_conf", tmp_path / "mine.yaml"], "--slurm_conf"),
                        (["--engine", "slurm", "--gpus", "0"], "--gpus"),
                        (["--engine", "slurn"], "--engine slurn")):
        res = run(script, "--data_dir", data, "--exp_dir", tmp_path / "exp", *args)
        assert res.returncode == 1 and named in res.stderr and len(res.stderr.splitlines()) == 1
        assert not data.exists() and not (tmp_path / "exp").exists()


def test_the_decode_stage_passes_the_grid_its_slurm_conf_and_batch_runs(tmp_path):
    """--slurm_conf (here a GPU partition's: the runs decode on cuda) and --batch_runs reach the
    decode stage's grid, as its dry run shows."""
    conf = tmp_path / "gpu.yaml"
    conf.write_text("slurm_partition: gpu\ngpus_per_node: 1\n")
    res = run(CHIME, "--stage", 3, "--stop_stage", 3, "--dry_run", "true", "--engine", "slurm",
              "--slurm_conf", conf, "--batch_runs", 2, "--methods", "suta", "--seeds", "0 1",
              "--data_dir", tmp_path / "data", "--exp_dir", tmp_path / "exp",
              env={"CHIME3": str(tmp_path / "C3"), "W2V2": str(tmp_path / "w2v2")})
    assert res.returncode == 0, res.stderr
    decodes = [x for x in res.stdout.splitlines() if "-m tta_brain.decode" in x]
    assert len(decodes) == 2 and all("--device=cuda" in x for x in decodes)
    assert [x for x in res.stdout.splitlines() if x.startswith("DRY-RUN: batch of 2 ")] == [
        "DRY-RUN: batch of 2 (one python -m tta_brain.sweep, or separate runs where it cannot "
        "batch them): chime3/suta/seed0, chime3/suta/seed1"]


def test_lsc_stage2_refusal_advises_the_recipe_option_and_names_every_stream(tmp_path):
    """A corrected transcript: stage 2 refused with the python CLI's advice ('use another --out,
    or pass --force', which run.sh does not take), naming one stream of one SNR per run."""
    make_librispeech(tmp_path / "corpus", speakers=(11, 12), chapters=(100,), utts=2)
    make_ms_snsd(tmp_path / "MS-SNSD", names=("AirConditioner_6",))
    env = {"LIBRISPEECH": str(tmp_path / "corpus"), "MS_SNSD": str(tmp_path / "MS-SNSD")}
    data = tmp_path / "data"
    opts = ["--stop_stage", 2, "--data_dir", data, "--snrs", "0 5", "--domains", "AC GS",
            "--streams", "AC GS"]
    res = run(LSC, *opts, env=env)
    assert res.returncode == 0, res.stderr
    trans = next((tmp_path / "corpus").rglob("*.trans.txt"))
    trans.write_text(trans.read_text().replace(" ", " FIXED ", 1))
    res = run(LSC, *opts, env=env)
    assert res.returncode == 1
    errors = [x for x in res.stderr.splitlines() if x.startswith("ERROR")]
    assert len(errors) == 2, res.stderr                 # both SNRs in one run
    for snr, err in zip((0, 5), errors):
        assert err.startswith(f"ERROR: 2 streams in {data}/snr{snr}/streams exist and a rebuild "
                              "differs from them (AC, GS; ")
        assert err.endswith(f"delete them, or rerun {LSC} with --force_streams true")
    res = run(LSC, *opts, "--force_streams", "true", env=env)
    assert res.returncode == 0, res.stderr
    assert "FIXED" in (data / "snr5" / "streams" / "GS.csv").read_text()
    assert "--force_streams true|false" in run(LSC, "--help").stdout
