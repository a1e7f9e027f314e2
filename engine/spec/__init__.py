"""Speculative decoding bookkeeping the scheduler needs: draft slots, accepted counts."""
