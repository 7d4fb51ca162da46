"""Training with CP: the data path, the DP x CP training step and checkpoints.

* [`cpref.train.data`][cpref.train.data]: `get_batch_on_this_cp_rank` (a packed batch, EOD-padded
  and sliced for this rank) and `cp_loss` (the loss normalised by the global number of loss tokens);
* [`cpref.train.packing`][cpref.train.packing]: documents packed into fixed-size batches;
* [`cpref.train.training`][cpref.train.training]: the DP x CP training step and loop;
* [`cpref.train.checkpoint`][cpref.train.checkpoint]: checkpoints that resume at another DP or CP
  size, written atomically, and [`cpref.train.checkpoint_files`][cpref.train.checkpoint_files],
  the files a save may touch;
* [`cpref.train.dcp`][cpref.train.dcp]: payloads through `torch.distributed.checkpoint` on real
  process groups (loaded on first use).
"""
