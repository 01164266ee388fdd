"""tools/bench_speed.py with a train-mode method: AWMC's adaptation passes are costed at a
train-mode unit pass (timed alongside), its inference / auxiliary forwards at the eval one."""
import json

import pytest


def test_bench_speed_costs_train_mode_methods_with_train_mode_units(tiny_model_dir, tmp_path, capsys):
    import bench_speed
    out = tmp_path / "bench.json"
    res = bench_speed.main(["--model", tiny_model_dir, "--n_utts", "2", "--seconds", "0.6",
                            "--repeats", "1", "--warmup", "1", "--methods", "suta,awmc",
                            "--suta_steps", "2", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "awmc (train)" in printed and "train mode (dropout" in printed
    assert "suta (train)" not in printed
    data = json.loads(out.read_text())
    for clock in ("wall", "cpu"):
        units = data["units"][clock]
        assert set(units) == {"unit_fb", "unit_f", "unit_fb_train"}
        fbt, f = units["unit_fb_train"]["rounds"][0], units["unit_f"]["rounds"][0]
        new, seen = units["unit_fb_train"]["new_length_rounds"][0], fbt
        c = res["awmc"]["counts_per_utt"]
        want = (c["adapt_backward"] * fbt + (c["adapt_forward"] - c["adapt_backward"]
                + c["infer_forward"] + c["aux_forward"]) * f + new - seen)
        assert abs(data["methods"]["awmc"][clock]["pass_s_per_audio_s"][0] - want) < 1e-12
        assert data["methods"]["awmc"][clock]["train_mode"] is True
        assert data["methods"]["suta"][clock]["train_mode"] is False
    # without a train-mode method: no third unit
    res = bench_speed.main(["--model", tiny_model_dir, "--n_utts", "1", "--seconds", "0.5",
                            "--repeats", "1", "--warmup", "1", "--methods", "suta",
                            "--suta_steps", "1", "--json", str(out)])
    assert set(json.loads(out.read_text())["units"]["wall"]) == {"unit_fb", "unit_f"}


def test_bench_speed_refuses_an_unknown_method_token_in_one_line(capsys):
    import bench_speed
    for token in ("nosuch", "suta+dynamik"):
        with pytest.raises(SystemExit):
            bench_speed.parse_args(["--methods", f"suta,{token}"])
        err = capsys.readouterr().err
        assert f"--methods: unknown method token '{token}'" in err and "Traceback" not in err
    assert bench_speed.parse_args(["--methods", "tent,dsuta+fixed"]).methods == "tent,dsuta+fixed"
