"""`nanovllm serve`'s command line: a user's mistake is one line that says what to change (no
traceback, no screens of usage), flags are never abbreviated, and an unknown one names the closest."""
import pytest

from nanovllm import LLM
from nanovllm.serve import cli


def _error_line(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli.parser().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err   # one line
    return err


def test_a_missing_model_folder_is_one_line_not_a_traceback(tmp_path):
    # SystemExit(message): Python prints the message alone on stderr and exits with status 1
    missing = str(tmp_path / "nope")
    with pytest.raises(SystemExit) as e:
        cli.serve([missing])
    assert e.value.code == (f"nanovllm serve: error: model folder {missing!r} does not exist (and it is "
                            "not a hub id like 'org/name')")


def test_bad_option_values_of_the_engine_are_one_line(capsys, qwen3_dir):
    with pytest.raises(SystemExit) as e:
        cli.serve([qwen3_dir, "--device", "tpu"])
    assert e.value.code == ("nanovllm serve: error: device must be one of ('auto', 'cuda', 'cpu'), "
                            "got 'tpu'")


def test_no_abbreviations_and_the_closest_flag_is_named(capsys):
    err = _error_line(capsys, ["m", "--max-num-seq", "4"])   # argparse took it as --max-num-seqs
    assert err.startswith("nanovllm serve: error: unrecognized option --max-num-seq: did you mean "
                          "--max-num-seqs? (nanovllm serve --help lists the options)")
    assert "did you mean --port?" in _error_line(capsys, ["m", "--prt=8001"])
    assert "did you mean" not in _error_line(capsys, ["m", "--zzzzzz"])
    assert cli.parser().parse_args(["m", "--max-num-seqs", "4"]).max_num_seqs == 4


def test_argparse_own_errors_are_one_line_too(capsys):
    err = _error_line(capsys, ["m", "--max-num-seqs", "x"])
    assert err.startswith("nanovllm serve: error: argument --max-num-seqs: invalid int value: 'x'")


def test_llm_names_the_closest_option(qwen3_dir):
    with pytest.raises(TypeError, match=r"unknown option 'max_num_seq' \(did you mean 'max_num_seqs'\?\); "
                                        r"valid options are: "):
        LLM(qwen3_dir, max_num_seq=4)
    with pytest.raises(TypeError, match=r"unknown options 'enforce_eagre' \(did you mean "
                                        r"'enforce_eager'\?\), 'zzz'; valid"):
        LLM(qwen3_dir, zzz=1, enforce_eagre=True)
