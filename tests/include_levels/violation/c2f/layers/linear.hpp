// The layer the violating kernel includes.
#pragma once
