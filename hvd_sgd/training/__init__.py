"""The training recipe's parts, which ``hvd_sgd.train.fit`` puts together in order: the run plan
(every derived number), the models, the optimizer wrapped for Horovod, precision, the learning-rate
schedule, the training loop and its progress report, and what rank 0 writes (outputs:
checkpoints, the timeline, the model, the metrics)."""
