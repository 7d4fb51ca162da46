"""Training with CP: the data path, the DP x CP training step and checkpoints.

* [`cpref.train.data`][cpref.train.data]: `get_batch_on_this_cp_rank` (a packed batch, EOD-padded
  and sliced for this rank) and `cp_loss` (the loss normalised by the global number of loss tokens);
* [`cpref.train.packing`][cpref.train.packing]: documents packed into fixed-size batches;
* [`cpref.train.training`][cpref.train.training]: the DP x CP training step and loop;
* [`cpref.train.checkpoint`][cpref.train.checkpoint]: checkpoints that resume at another DP or CP
  size, written atomically; [`checkpoint_meta`][cpref.train.checkpoint_meta], what they record
  and whether one fits a run; [`checkpoint_files`][cpref.train.checkpoint_files], the files a save
  may touch; [`checkpoint_swap`][cpref.train.checkpoint_swap], the write, swap and recovery that a
  crash cannot break; [`checkpoint_lock`][cpref.train.checkpoint_lock], one run at a time saving
  into a directory; [`checkpoint_errors`][cpref.train.checkpoint_errors], a failed save in one line
  on every rank;
* [`cpref.train.dcp`][cpref.train.dcp]: payloads through `torch.distributed.checkpoint` on real
  process groups (loaded on first use).
"""
