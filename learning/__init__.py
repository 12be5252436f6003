"""The built-in RL learner: advantages, PPO losses, the Trainer, metrics and Parquet export.

The learner actor calls it like this (torch is imported only by `rollway.learning.trainer`):

    from rollway.learning.trainer import Trainer
    trainer = Trainer(cfg.learner, run_dir, group_size=cfg.scheduler.group_size)
    for result in trainer.add(trajectory):          # 0 or 1 results per call, usually
        publish(PolicyVersion(version=result.version, checkpoint=str(result.checkpoint_path),
                              step=result.step, episodes_trained=result.episodes_trained,
                              metrics=result.metrics))
    trainer.tick()    # periodically: trains groups past learner.group_timeout_s
    trainer.flush()   # at shutdown: trains complete groups below groups_per_step
"""
