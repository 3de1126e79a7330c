"""Distillation through Tunix's ``DistillationTrainer``: a frozen teacher's logits into a
student, our train step in front (:mod:`posttrain.distill.trainer`); what differs across
Tunix releases is read by feature in :mod:`posttrain.distill.tunix_distill`."""
