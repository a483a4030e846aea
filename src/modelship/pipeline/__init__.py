"""modelship.pipeline"""
