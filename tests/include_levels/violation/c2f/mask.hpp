// The mask vocabulary the violating micro-kernel includes.
#pragma once
