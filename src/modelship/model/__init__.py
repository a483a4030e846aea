"""modelship.model"""
