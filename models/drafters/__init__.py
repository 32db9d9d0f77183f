"""specloop.models.drafters"""
