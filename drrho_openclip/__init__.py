"""drrho-openclip: DRRho-CLIP and DRO contrastive losses for OpenCLIP's training loop, as a plugin."""
__version__ = '0.1.0'
