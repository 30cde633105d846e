"""Programs that run on the emulated network: training scripts and stand-ins (see README.md).

Training scripts: :mod:`~examples.train_ddp` (an ordinary DDP script plus its
Checkmate lines), :mod:`~examples.train_lm` (TinyLM, :mod:`experiments.tiny_lm`, with
DDP, resumable; what ``make demo`` and ``make bench`` run in the workers). Stand-ins:
:mod:`~examples.send_tagged` (a worker that sends tagged datagrams), :mod:`~examples.capture` (a shadow
that only records what arrives) and :mod:`~examples.ddp_probe` (records what a
DDP script's Checkmate agent did).
"""
