"""Live recovery: a lost data-parallel rank costs no restart and no step (--live-recovery); under pp,
tp or cp a lost rank retires its whole replica, and the other replicas go on (replicas.py).

Without it, any failure ends every process and the job restarts from the last checkpoint
(fault.py, docs/fault-tolerance.md). With it the survivors carry on in the same processes:

    rank 2 killed ──► a survivor's collective fails (gloo: the connection closed) ──┐
    rank 1 frozen ──► a survivor's heartbeat finds it silent for --heartbeat-timeout ─┤
                                                                                     ▼
    it sets live/E/abort in the rendezvous store; every member's heartbeat thread reads it and
    sets comm.abort, and each rank's wait in a collective gives up (comm.Aborted)
    each survivor writes its flight log (RUN/flight/live-E/), says it is here and waits; one
    decision on the members is written to the store (members.py)
    survivors: a new process group on the same store (prefix live/E+1/pg), the mesh over them,
    the state brought level and -- ZeRO 1-3 -- re-sharded over them from the buddy copies
    (state.py, parallel/mirror.py), the lost ranks' sequences of the step divided among them
    (redo.py); the step is done again, whole

Ranks keep their number (the heartbeat's keys, the checkpoint's file names, the flight logs' names);
the process group numbers the members 0..n-1 in rank order. The store lives in rank 0's process
(-pi tcp / -pi fs), so rank 0 is the one rank whose loss cannot be recovered live: the survivors
find the store gone and fall back to the restart path (exit 75), as they do when the main thread is
stuck where it cannot be interrupted, a peer is lost between two steps (a checkpoint save, a
validation; after the last step the final save and validation are recovered), no agreement comes in time, a
rank of rank 0's replica is lost (pp, tp, cp), or -- ZeRO 1-3 -- a rank is lost with its buddy, or
one rank (one replica) would be left.
Past the run's last collective rank 0 writes "complete" in the place of the epoch's decision, and
keeps the store up until every member has closed it: a member whose wait is given up then (it had
not yet seen that collective complete) reads it and ends as a finished run's rank.

  trainer.py   LiveTrainer: the step that survives a loss, recover, grow (a joiner in)
  members.py   the agreement on the members through the store; the membership log
  redo.py      the step's micro-batches over the members left, summed by global number
  replicas.py  a lost rank's replica retired (pp, tp, cp); the world rebuilt over the ranks left
  state.py     the state brought level, sent to a joiner, re-sharded; checked by sha256
  join.py      a process that joins a running job in place of a lost rank (--join)
"""

from braidtrain.live.trainer import LiveTrainer, check_config

__all__ = ["LiveTrainer", "check_config"]
