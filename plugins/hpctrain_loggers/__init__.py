"""The built-in logger backends beyond ``jsonl``: TensorBoard, Weights & Biases
(offline by default) and MLflow (a local file store by default), one plugin
module each, registered as entry points exactly as a third-party logger
would be (``logging.backends=[jsonl,tensorboard,wandb,mlflow]``).

Each module imports its library only when its logger is made, so an
installation without the library still lists the backend and validation
names the extra to install (``pip install 'hpctrain[tensorboard]'``...).
"""
