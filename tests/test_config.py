"""Unit tests: the command line becomes one validated, typed configuration."""
import sys

import pytest

from hvd_sgd import JobError, config


def parse(*argv):
    return config.parse(config.TrainConfig, list(argv))


def test_defaults_work_and_flags_are_typed():
    assert parse() == config.TrainConfig()
    cfg = parse("--model", "mlp", "--batch-size", "32", "--lr", "0.5", "--no-lr-scaling", "--max-steps", "7", "--resume",
                "--checkpoint-dir", "/tmp/x")
    assert (cfg.model, cfg.batch_size, cfg.lr, cfg.lr_scaling, cfg.max_steps, cfg.resume) == ("mlp", 32, 0.5, False, 7, True)


@pytest.mark.parametrize("argv,message", [
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--batch-size", "-3"], "--batch-size must be at least 1"),
    (["--epochs", "0"], "--epochs must be at least 1"),
    (["--max-steps", "0"], "--max-steps must be at least 1"),
    (["--lr", "0"], "--lr must be a positive number"),
    (["--lr", "nan"], "--lr must be a positive number"),
    (["--momentum", "1"], r"--momentum must be in \[0, 1\)"),
    (["--warmup-epochs", "-1"], "--warmup-epochs must be zero or more"),
    (["--warmup-epochs", "2", "--epochs", "2"], "--warmup-epochs 2 leaves none of --epochs 2 for the cosine decay"),
    (["--threads-per-rank", "-1"], "--threads-per-rank must not be negative"),
    (["--backward-passes-per-step", "0"], "--backward-passes-per-step must be at least 1"),
    (["--seed", "-1"], r"--seed must be in \[0, 2\*\*32\), got -1"),
    (["--seed", str(2**32)], r"--seed must be in \[0, 2\*\*32\)"),
    (["--save-model", "out"], r"--save-model out: name a .keras file \(or .h5"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--model", "resnet"], "invalid choice: 'resnet'"),
    (["--model", "mymodels:"], "invalid choice: 'mymodels:'"),
    (["--dataset", "cifar"], "invalid choice: 'cifar'"),
    (["--batch-size", "many"], "invalid int value: 'many'"),
    (["--data-dir", "/no/such/dir"], "no such directory"),
    (["--data-dir", "/no/such/file.npz"], "no such directory or .npz file"),
    (["--stall-timeout", "inf"], "--stall-timeout must be a positive number"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_values_are_one_line_errors(argv, message):
    with pytest.raises(JobError, match=message) as error:
        parse(*argv)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("argv,message", [(["--seed", "-1"], "--seed must be in"), (["--steps", "0"], "--steps must be at least 1"),
                                          (["--lr", "-0.5"], "--lr must be a positive number")])
def test_the_tf1_programs_bad_values_are_one_line_errors(argv, message):
    with pytest.raises(JobError, match=message):
        config.parse(config.TrainV1Config, argv)


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse("--help")
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for field in config.TrainConfig.__dataclass_fields__.values():
        flag = field.metadata["flag"] or "--" + field.name.replace("_", "-")
        assert flag in text


def test_a_users_model_is_named_by_module_and_function():
    assert parse("--model", "my_package.models:build").model == "my_package.models:build"


def test_a_negated_flag_says_what_it_turns_off(capsys):
    with pytest.raises(SystemExit):
        parse("--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "--no-lr-scaling turn off the linear scaling rule" in text
    assert "--no-bind-cpus turn off binding each rank" in text


@pytest.mark.parametrize("program,usage", [("/x/hvd_sgd/train.py", "python -m hvd_sgd.train"),
                                           ("/x/bin/hvd-sgd", "hvd-sgd")])
def test_help_names_the_command_and_keeps_the_descriptions_lines(capsys, monkeypatch, program, usage):
    monkeypatch.setattr(sys, "argv", [program, "--help"])
    description = "Train.\n\n    mpirun -np 4 python -m hvd_sgd.train\n    python -m hvd_sgd.train\n"
    with pytest.raises(SystemExit):
        config.parse(config.TrainConfig, None, description, module="hvd_sgd.train")
    text = capsys.readouterr().out
    assert text.startswith(f"usage: {usage} [-h]")
    assert "\n    mpirun -np 4 python -m hvd_sgd.train\n    python -m hvd_sgd.train\n" in text
    assert "per rank per backward pass; the global batch is this x ranks x --backward-passes-per-step " \
           "(default: 32)" in " ".join(text.split())  # each flag's help still ends with its default
