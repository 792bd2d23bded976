"""The config doctor: read a DeepSpeed config the way DeepSpeed reads it (``load``), say what takes effect
(``effective``), report what is wrong for inference (``check``) and write a clean inference config (``split``)."""
