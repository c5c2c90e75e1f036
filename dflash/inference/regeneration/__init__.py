"""The parts of data regeneration (``python -m dflash.inference.regenerate``, its command line).

- ``rows``: source rows, their stable ids, which worker owns which row, per-turn sampling seeds;
- ``shards``: each worker's shard file (append under its lock), finished ids, the merge into the output;
- ``generators``: one turn of generation for a batch of prompts (greedy or sampled, through the static cache);
- ``jobs``: the generation options and one conversation regenerated turn by turn, batched over rows;
- ``worker``: one worker process (load the target, regenerate its shard);
- ``launcher``: start the workers (:mod:`dflash.runtime.supervisor`), show progress, merge, report.
"""
