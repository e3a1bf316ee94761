"""Progress on long work: off a terminal, an epoch still reports its step and an ETA."""

from compresskit.cli import render


def test_off_a_terminal_a_long_epoch_prints_step_and_eta(monkeypatch, capsys):
    monkeypatch.setattr(render, "LINE_EVERY_S", 0.0)
    p = render.TrainProgress(quiet=False)
    p.live = False  # as in a pipe or a CI log
    p.epoch_start(1, 2, steps=10, done=0)
    p.step(1, 4, 0.5)
    err = capsys.readouterr().err
    assert "epoch 1/2: step 4/10" in err and "eta" in err


def test_quiet_progress_prints_nothing(monkeypatch, capsys):
    monkeypatch.setattr(render, "LINE_EVERY_S", 0.0)
    p = render.TrainProgress(quiet=True)
    p.epoch_start(1, 1, steps=10, done=0)
    p.step(1, 4, 0.5)
    p.info("stage line")
    assert capsys.readouterr().err == ""
